"""Convert a checkpoint (HF dir, GGUF file or jaxkv checkpoint) to jaxkv format.

    python -m checkpoints.convert SRC DST [--dtype float32|bfloat16] [--overwrite]
                                  [--no-verify-checksums]

It prints what it wrote: the parameters, a mixture of experts' expert
parameters among them and those one token runs through, and the bytes.
A bad source is one line on stderr ("error: ..." naming the file, field or
tensor) and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from checkpoints import load_checkpoint
from checkpoints.dtypes import cast_params
from checkpoints.jaxkv_format import save


def summary(config, params) -> str:
    """ "N parameters[, E in X experts, A active per token], B bytes" of the
    saved arrays (the active count from the planner)."""
    from jaxkv.model.memory import active_param_count

    total = sum(int(v.size) for v in params.values())
    nbytes = sum(int(v.nbytes) for v in params.values())
    X = getattr(config, "num_experts", 0)
    if not X:
        return f"{total:,} parameters, {nbytes:,} bytes"
    experts = sum(int(v.size) for k, v in params.items() if ".experts_" in k)
    return (
        f"{total:,} parameters, {experts:,} in {X} experts, "
        f"{active_param_count(config):,} active per token, {nbytes:,} bytes"
    )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    progress: bool = True,
    verify_checksums: bool = True,
) -> Path:
    """Load ``src`` (any supported kind), cast to ``dtype`` and save it at
    ``dst`` with fresh checksums; ``verify_checksums=False`` skips checking
    a jaxkv source's."""
    config, params, tokenizer = load_checkpoint(
        src, dtype=dtype, progress=progress, verify_checksums=verify_checksums
    )
    params = cast_params(params, dtype)
    out = save(dst, config, params, tokenizer, overwrite=overwrite)
    if progress:
        print(f"{out}: {summary(config, params)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints.convert", description=__doc__.splitlines()[0]
    )
    parser.add_argument("src", help="HF model dir, GGUF file or jaxkv checkpoint dir")
    parser.add_argument("dst", help="output jaxkv checkpoint dir")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--no-verify-checksums",
        dest="verify",
        action="store_false",
        help="do not check a jaxkv SRC's tensor checksums (faster)",
    )
    args = parser.parse_args(argv)
    try:
        out = convert(
            args.src, args.dst, args.dtype, overwrite=args.overwrite, verify_checksums=args.verify
        )
    except ValueError as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
