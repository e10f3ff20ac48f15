"""Regenerate the protobuf and gRPC stubs under pagedserve/ from protos/, with grpcio-tools.

Run it after editing a .proto file: `python scripts/gen_protos.py`. tests/unit/test_protos.py fails
while the committed stubs differ from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every .proto under protos/ into out_dir; return the files written."""
    from grpc_tools import protoc

    protos = sorted(PROTOS.rglob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its message above")
    for package in {p.relative_to(PROTOS).parent for p in protos}:
        for folder in [package, *package.parents][:-1]:  # every package folder below out_dir
            (out_dir / folder / "__init__.py").touch()
    return generated_files(out_dir)


def generated_files(root: Path) -> list[Path]:
    """The stub files under root/pagedserve, relative to root."""
    return sorted(
        p.relative_to(root) for p in (root / "pagedserve").rglob("*") if p.name.endswith(GENERATED_SUFFIXES)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="where the pagedserve/ stubs go")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
