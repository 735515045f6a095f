#!/usr/bin/env bash
# Stage the wheel set that lets sglang 0.5.17 run on an offline H200 GPU host image
# (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, triton 3.6.0).
#
# Run HERE (a machine with pip and internet), in the repo root:
#     bash tools/gpu/stage_wheels.sh            # -> .whl/ (git-ignored)
# Then copy .whl/ to the GPU host with the repo (see docs/gpu.md).
#
# Everything is downloaded with --no-deps: only packages that are missing from the
# image are named, with exact versions.
# Five wheels are slimmed so the whole set stays under 64 MiB:
#   sglang          drop multimodal_gen/ (diffusion) and the Rust _core.so files
#                   (server/grpc/multimodal; imported lazily, only in rust/grpc modes)
#   sglang-kernel   keep sm90/common_ops + python; drop flash_ops (FA3, 1.1 GB
#                   unpacked), sm100/, flashmla_ops, infllm_ops (all lazily loaded)
#   flashinfer      drop data/cutlass and data/cccl headers (only for JIT of kernels
#                   we do not use: attention=triton, sampling=pytorch)
#   torch-memory-saver  keep the _cu13 hook libraries only
#   xgrammar        drop lib/libxgrammar.a and include/ (static lib + headers for
#                   C++ users); the Python bindings .so stays
# IPython is not carried: tools/gpu/stubs/IPython stands in (sglang/utils.py only
# imports IPython.display.HTML/display for notebooks).
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
D=.whl
rm -rf "$D"; mkdir -p "$D"
PLAT=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
PKGS=(
  # core
  sglang==0.5.17
  sglang-kernel==0.4.5
  flashinfer-python==0.6.15.post1
  apache-tvm-ffi==0.1.11
  torch-memory-saver==0.0.10
  xgrammar==0.2.1
  # engine-path pure/small packages missing from the image
  msgspec==0.23.0
  pyzmq==27.3.0
  orjson==3.13.0
  pybase64==1.5.1
  setproctitle==1.3.8
  dill==0.4.1
  partial-json-parser==0.2.1.1.post7
  compressed-tensors==0.20.1
  loguru==0.7.3
  gguf==0.19.0
  openai==2.6.1
  distro==1.9.0
  jiter==0.19.0
  sniffio==1.3.1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.7.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  fastapi==0.140.0          # newer fastapi requires opentelemetry-api
  starlette==0.50.0
  uvicorn==0.54.0
  # HTTP server only
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  soundfile==0.13.1
  cffi==2.1.1
  pycparser==3.12
  zstandard==0.25.0
  python-multipart==0.0.34
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLAT[@]}" -d "$D" "${PKGS[@]}" 2>&1 | grep -v "^WARNING: Location" || true

R="python3 tools/gpu/repack_wheel.py"
$R "$D"/sglang-0.5.17-*.whl 'sglang/multimodal_gen/*' \
   'sglang/srt/server/_core*.so' 'sglang/srt/grpc/_core*.so' 'sglang/srt/multimodal/_core*.so'
$R "$D"/sglang_kernel-0.4.5-*.whl 'sgl_kernel/flash_ops*.so' 'sgl_kernel/sm100/*' \
   'sgl_kernel/flashmla_ops*.so' 'sgl_kernel/infllm_ops*.so'
$R "$D"/flashinfer_python-0.6.15.post1-*.whl 'flashinfer/data/cutlass/*' 'flashinfer/data/cccl/*'
$R "$D"/xgrammar-0.2.1-*.whl 'xgrammar/lib/*' 'xgrammar/include/*'
$R "$D"/torch_memory_saver-0.0.10-*.whl 'torch_memory_saver_hook_mode_*_cu12.abi3.so' \
   'torch_memory_saver_hook_mode_preload.abi3.so' 'torch_memory_saver_hook_mode_torch.abi3.so'

for w in "$D"/*.whl; do  # the rest: recompressed only (LZMA), to fit repo + wheels + JIT cache in 64 MiB
  case "$(basename "$w")" in sglang-0.5.17-*|sglang_kernel-*|flashinfer_python-*|xgrammar-*|torch_memory_saver-*) ;; *) $R "$w" > /dev/null ;; esac
done

echo "--- wheels in $D"
ls -l "$D" | awk 'NR>1{printf "%8.2f MB  %s\n", $5/1e6, $9}'
du -cb "$D"/*.whl | tail -1 | awk '{printf "TOTAL %.2f MB (%.2f MiB; keep repo + wheels under 64 MiB)\n", $1/1e6, $1/1048576}'
