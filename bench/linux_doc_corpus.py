"""Prepare the GPU-scale benchmark's corpus: the Linux kernel's documentation as Debian ships it.

    python bench/linux_doc_corpus.py [--deb linux-doc-6.1_*.deb] [--out bench/data/linux-doc]

Without ``--deb`` it runs ``apt-get download linux-doc-6.1`` (a Debian registry is all it needs).
It unpacks the package's ``Documentation`` tree, keeps the reStructuredText and plain-text files
(``.rst``, ``.txt``; gzip-compressed in the package), drops any that is not UTF-8 text (a line says
which), and writes them under ``--out`` with their relative paths: a ``data.source = "files"``
corpus (bench/compare-gpu.toml). 3,183 .rst and 1,944 .txt files, 28.5 MB, in linux-doc-6.1
6.1.192-2; the run pins nothing, so the benchmark's JSON records the corpus hash and size instead.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
from pathlib import Path

KEEP = (".rst", ".txt")


def unpack(deb: Path, into: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    docs = next(into.glob("usr/share/doc/linux-doc-*/Documentation"), None)
    if docs is None:
        raise SystemExit(f"{deb}: no usr/share/doc/linux-doc-*/Documentation inside; is it the linux-doc package?")
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deb", type=Path, help="a downloaded linux-doc-6.1 .deb (default: apt-get download it)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data" / "linux-doc")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty: remove it first, or point --out elsewhere")
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", "linux-doc-6.1"], cwd=tmp, check=True)
            deb = next(Path(tmp).glob("linux-doc-6.1_*.deb"))
        docs = unpack(deb.resolve(), Path(tmp) / "x")
        kept = skipped = size = 0
        for path in sorted(docs.rglob("*")):
            name = path.name[:-3] if path.name.endswith(".gz") else path.name
            if path.is_symlink() or not path.is_file() or not name.endswith(KEEP):
                continue
            raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                print(
                    f"skipped {path.relative_to(docs)}: not UTF-8 ({exc.reason} at byte {exc.start})", file=sys.stderr
                )
                skipped += 1
                continue
            target = args.out / path.relative_to(docs).parent / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
            kept, size = kept + 1, size + len(raw)
    print(f"wrote {kept} files, {size / 1e6:.1f} MB, to {args.out} ({skipped} skipped)")


if __name__ == "__main__":
    main()
