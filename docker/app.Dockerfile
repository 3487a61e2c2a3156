# The image of the ServerApp and ClientApp executors (SuperExec): Flower's own SuperExec image plus this
# project's dependencies. The app's code is not copied in: it arrives with every run (the FAB that
# `flwr run` builds), so one image serves every version of the app.
#
# By default torch comes from PyPI, which on Linux x86_64 is the CUDA build (it runs on CPUs too). For a
# smaller CPU-only image, point pip at PyTorch's CPU wheel index:
#   docker compose build --build-arg TORCH_PIP_ARGS="--index-url <PyTorch CPU wheel index URL>"
ARG FLWR_VERSION=1.41.0
FROM flwr/superexec:${FLWR_VERSION}

ARG TORCH_PIP_ARGS=""
# The dependencies come from pyproject.toml (one source of truth); flwr is already in the base image.
COPY pyproject.toml /tmp/fedssl/pyproject.toml
RUN python -c "import tomllib; deps = tomllib.load(open('/tmp/fedssl/pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.split('[')[0].strip().startswith('flwr')))" \
        > /tmp/fedssl/requirements.txt \
    && python -m pip install --no-cache-dir ${TORCH_PIP_ARGS} -r /tmp/fedssl/requirements.txt

ENTRYPOINT ["flower-superexec"]
