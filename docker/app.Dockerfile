# The image of the ServerApp and ClientApp executors (SuperExec): Flower's own SuperExec image plus this
# project's dependencies. The app's code is not copied in: it arrives with every run (the FAB that
# `flwr run` builds), so one image serves every version of the app.
#
# Build arguments (compose passes them from the variables of the same name):
#   TORCH_PIP_ARGS  where torch and torchvision come from. Empty (default): the package index, which on Linux
#                   x86_64 serves the CUDA build (GPU-ready; it runs on CPUs too, in a ~6 GB image). For a
#                   CPU-only image (~1.4 GB) point pip at a CPU wheel source, e.g. PyTorch's CPU index:
#                   TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
#   PIP_ARGS        extra pip arguments for every install (a mirror, a wheel folder: "--no-index --find-links URL")
#
# The app imports torchvision only to download a data set (data.download); a CPU torch needs torchvision's CPU
# build from the same source, else torchvision installs but its C++ operators do not load.
#
# Layers, slowest first: torch (rebuilt only when the torch arguments change), then the other dependencies
# from pyproject.toml (rebuilt when it changes; torch stays), then the folders the volumes mount on.
ARG FLWR_VERSION=1.42.0
FROM flwr/superexec:${FLWR_VERSION}

ARG PIP_ARGS=""
ARG TORCH_PIP_ARGS=""
# Must agree with pyproject.toml's torch and torchvision requirements (tests/test_compose_files.py checks it).
ARG TORCH_REQUIREMENTS="torch>=2.4 torchvision>=0.19"
RUN python -m pip install --no-cache-dir ${PIP_ARGS} ${TORCH_PIP_ARGS} ${TORCH_REQUIREMENTS}

# The other dependencies come from pyproject.toml (one source of truth); flwr is already in the base image.
# The base image runs as user `app`, who can write /tmp but not a folder that COPY creates (owned by root).
COPY pyproject.toml /tmp/fedssl-pyproject.toml
RUN python -c "import tomllib; deps = tomllib.load(open('/tmp/fedssl-pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.split('[')[0].strip().startswith('flwr')))" \
        > /tmp/fedssl-requirements.txt \
    && python -m pip install --no-cache-dir ${PIP_ARGS} -r /tmp/fedssl-requirements.txt \
    && rm /tmp/fedssl-requirements.txt \
    && python -c "import importlib.metadata as m, torch, numpy, yaml, flwr; print('torch', torch.__version__, 'torchvision', m.version('torchvision'), 'flwr', flwr.__version__)"

# Mount points owned by `app` (uid 49999): a named volume mounted here starts out owned by it, not by root.
RUN mkdir -p /app/state /app/outputs

ENTRYPOINT ["flower-superexec"]
