#!/usr/bin/env bash
# Try docker/'s compose files for real on this machine: build the images (Flower's official ones, or local stand-ins
# where Docker Hub cannot be reached) and run the compose flows of tests/test_docker_compose.py: one host with TLS
# and SuperNode authentication, then separate server and client projects (a refused unregistered node, a client
# stopped after round 1 and back for round 3). Uses a running Docker engine, or starts dockerd (as root) and stops
# it afterwards. Prints the image sizes and build times; FEDSSL_DOCKER_RECORD=file.json keeps them.
#
#   bash docker/try-compose.sh            # from the repository root, in the project's Python environment
#   bash docker/try-compose.sh -k one_host  # only the one-host flow
#
# Needs: docker (CLI and engine, or dockerd as root), docker compose or docker-compose, openssl, ssh-keygen,
# debootstrap (stand-ins only), the CIFAR-10 dev copy (../shared/data/cifar10-dev.npz or $FEDSSL_CIFAR10_NPZ).
# Images stay as the next run's cache (about 2 GB); wheels are cached in ${FEDSSL_DOCKER_CACHE:-~/.cache/fedssl-docker}.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0
# Its own temporary folder: pytest removes old ones when other pytest runs start (containers write in it).
FEDSSL_NO_SKIP=1 exec python3 -m pytest -s -q -p no:cacheprovider --basetemp="${TMPDIR:-/tmp}/fedssl-try-compose" \
  tests/test_docker_compose.py "$@"
