"""Write a model repository for Triton's PyTorch (libtorch) backend, as in NGC images.

    python -m python_backend.export_torchscript --out DIR [--kind KIND_GPU|KIND_CPU]

``DIR/embed``: the same encoder as the Python-backend ``embed`` (same seed, same weights),
scripted with ``torch.jit.script`` and served with ``platform: "pytorch_libtorch"``: no
Python in the request path. ``DIR/generate``: the Python-backend ``generate`` with its
``configs/gpu.pbtxt`` (or the CPU config) as ``config.pbtxt``; a token-by-token decode loop
with a cache does not fit one TorchScript ``forward`` call, so it stays in Python.

Naming for the libtorch backend: inputs are matched to ``forward``'s argument names
(``forward(self, INPUT_IDS)``, the backend's FORWARD_ARGUMENT convention);
the single output has no ``__<index>`` suffix, so the backend maps outputs by their order
in the config (STRICT_CONFIG_ORDERING): ``EMBEDDING`` is output 0.

Differences from the Python-backend ``embed``, all forced by the libtorch backend:
- no ``fair_rows`` parameter (the backend does not pass request parameters to
  TorchScript), hence no row lengths: every row is as long as ``INPUT_IDS`` is wide. A
  frontend in front of it must not pad ragged rows together: leave ``padding`` out of its
  ``embed`` endpoint, so that only rows of equal width share a batch.
- no ``ROW_META`` output, no per-tenant counters.
- Triton's batcher only combines requests of equal width (no ``allow_ragged_batch``: the
  backend would concatenate ragged rows into one flat tensor).
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from python_backend import nets

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"

EMBED_LIBTORCH_CONFIG = """\
# embed as TorchScript for the PyTorch (libtorch) backend; written by
# python -m python_backend.export_torchscript. Rows are never padded here: every row is
# as long as INPUT_IDS is wide (a frontend in front must not pad: no padding on embed).
name: "embed"
platform: "pytorch_libtorch"
max_batch_size: 32
dynamic_batching {{}}
input [
  {{ name: "INPUT_IDS", data_type: TYPE_INT32, dims: [ -1 ] }}
]
output [
  {{ name: "EMBEDDING", data_type: TYPE_FP32, dims: [ {dim} ] }}
]
instance_group [ {{ kind: {kind}, count: 1 }} ]
"""


class ScriptedEmbed(nn.Module):
    """The encoder with the Python backend's input handling, in TorchScript.

    Same arithmetic as ``EmbedModel`` for one request of a direct client: ids modulo the
    vocabulary (never negative), every row as long as the input is wide.
    """

    def __init__(self, encoder: nets.TokenEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.vocab = encoder.vocab

    def forward(self, INPUT_IDS: Tensor) -> Tensor:
        rows, width = INPUT_IDS.shape[0], INPUT_IDS.shape[1]
        lengths = torch.full((rows,), width, dtype=torch.int64, device=INPUT_IDS.device)
        ids = torch.remainder(INPUT_IDS.to(torch.int64), self.vocab)
        return self.encoder(ids, lengths)


def script_embed(seed: int = nets.EMBED_SEED) -> torch.jit.ScriptModule:
    """The ``embed`` encoder, from its fixed seed, as a TorchScript module.

    PyTorch 2.13 marks ``torch.jit.script`` deprecated in favour of ``torch.export``, but
    TorchScript is what the libtorch backend (``platform: "pytorch_libtorch"``) loads.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        return torch.jit.script(ScriptedEmbed(nets.build_encoder(seed)))


def export(out: Path, kind: str = "KIND_GPU") -> Path:
    """Write ``out/embed`` (TorchScript) and ``out/generate`` (Python backend); return ``out``."""
    embed_dir = out / "embed"
    (embed_dir / "1").mkdir(parents=True, exist_ok=True)
    script_embed().save(str(embed_dir / "1" / "model.pt"))
    (embed_dir / "config.pbtxt").write_text(
        EMBED_LIBTORCH_CONFIG.format(dim=nets.D_MODEL, kind=kind)
    )
    generate_src = REPOSITORY / "generate"
    generate_dir = out / "generate"
    shutil.rmtree(generate_dir, ignore_errors=True)
    shutil.copytree(
        generate_src / "1", generate_dir / "1", ignore=shutil.ignore_patterns("__pycache__")
    )
    source = "configs/gpu.pbtxt" if kind == "KIND_GPU" else "config.pbtxt"
    (generate_dir / "config.pbtxt").write_text(
        f"# Copied by python -m python_backend.export_torchscript from generate/{source}.\n"
        + (generate_src / source).read_text()
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="model repository to write")
    parser.add_argument("--kind", default="KIND_GPU", choices=["KIND_GPU", "KIND_CPU"])
    args = parser.parse_args(argv)
    print(export(args.out, args.kind))


if __name__ == "__main__":
    main()
