#!/usr/bin/env bash
# Runs the e2e suite on a fresh kind cluster: builds both images, loads them into kind, runs pytest, deletes the
# cluster. Needs docker, kind and the repository's .venv (make install). Usage: e2e/run-kind.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER="${PAGODA_E2E_CLUSTER:-pagoda-e2e}"
OPERATOR_IMAGE="pagoda-operator:e2e"
ENGINE_IMAGE="pagoda-engine:e2e"

docker build -f Dockerfile.operator -t "$OPERATOR_IMAGE" .
# The CPU example needs no GPU: a CPU torch build keeps the image small for kind.
docker build -f Dockerfile.engine -t "$ENGINE_IMAGE" \
  --build-arg CUDA_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .

kind create cluster --name "$CLUSTER"
trap 'kind delete cluster --name "$CLUSTER"' EXIT
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$ENGINE_IMAGE"

PAGODA_E2E_CLUSTER="$CLUSTER" PAGODA_E2E_OPERATOR_IMAGE="$OPERATOR_IMAGE" PAGODA_E2E_ENGINE_IMAGE="$ENGINE_IMAGE" \
  .venv/bin/python -m pytest e2e -v "$@"
