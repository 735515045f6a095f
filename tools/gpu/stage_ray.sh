#!/usr/bin/env bash
# Stage a slim ray 2.60.0 wheel for the offline GPU host (Python 3.12) into .whl-ray/ of the repo root.
#
# The full wheel is 79 MB: over what one device call carries next to the 57.8 MiB sglang set.
# Slimmed (Java jars, the dashboard's web build, rllib/tune/train/serve/data/llm dropped) it is
# ~29 MB (LZMA): ray core (GCS, raylet, actors, placement groups, GPUs) stays whole. Ray core also
# imports jsonschema, which the host image lacks (seen on the H200 on 2026-12-03: `import ray` failed
# with "No module named 'jsonschema'"): jsonschema and its four dependencies travel with it (~0.5 MB).
#
# It cannot travel with the sglang set in one call (39 + 58 > 64 MiB), so use two calls on one
# warm machine (the machine stays warm ~30 s after a call; /tmp survives while it is warm):
#   call 1, carry [".whl-ray"]:  bash tools/gpu/install_ray_on_device.sh
#   call 2, carry [".whl"]:      source tools/gpu/install_on_device.sh; export PYTHONPATH=/tmp/site-ray:$PYTHONPATH; ...
# If call 2 lands on a fresh machine (/tmp/site-ray missing), repeat call 1.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=.whl-ray
rm -rf "$D"; mkdir -p "$D"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$D" ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 2>&1 | grep -v "^WARNING: Location" || true
python3 tools/gpu/repack_wheel.py "$D"/ray-2.60.0-*.whl 'ray/jars/*' 'ray/dashboard/client/build/*' \
  'ray/rllib/*' 'ray/tune/*' 'ray/serve/*' 'ray/data/*' 'ray/llm/*' 'ray/train/*'
ls -l "$D"
