#!/usr/bin/env bash
# Installs the libtpu wheel into the active Python environment so the TPU
# Pallas kernel can be compiled deviceless (no TPU needed) in the lowering
# tests. Takes the libtpu version the installed jax's "tpu" extra pins, else
# the newest. Never fails the caller: without libtpu those tests skip.
spec=$(python - <<'PY' 2>/dev/null
from importlib.metadata import requires
for r in requires("jax") or []:
    if r.startswith("libtpu") and 'extra == "tpu"' in r:
        print(r.split(";")[0].replace(" ", ""))
        break
PY
)
for want in ${spec:+"$spec"} libtpu; do
  if python -m pip install -q "$want"; then
    echo "install_tpu_compiler: installed $want"
    exit 0
  fi
done
echo "install_tpu_compiler: could not install libtpu; TPU compile tests will be skipped" >&2
exit 0
