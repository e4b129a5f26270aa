"""Print the project's pinned runtime requirements, one per line, for an image to install.

    python3 docker/requirements.py [--pyproject pyproject.toml] [--without NAME ...]
                                   [--extras NAME=EXTRA,EXTRA ...]

The pins live in one place, ``pyproject.toml``; the Dockerfiles install from them with
``pip install -r`` and then the project itself with ``--no-deps``, so that an image can
leave out what it does not need or gets elsewhere:

- the Triton image (``Dockerfile``) leaves out ``nvidia-pytriton`` (the NGC image has its
  own ``tritonserver``) and ``torch`` (installed first from a CUDA index);
- the serve image (``Dockerfile.serve``) also drops tritonclient's extras but ``grpc``
  (the frontend imports only ``tritonclient.grpc``), and ``torch`` (only the models use it).

Runs on Python 3.10 (the NGC 24.x images), where ``tomllib`` does not exist yet: the
``dependencies`` array is then read with a regular expression, which suffices for the
one-string-per-line form the project's ``pyproject.toml`` uses.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def canonical(name: str) -> str:
    """PEP 503 normalisation: ``Nvidia_PyTriton`` and ``nvidia-pytriton`` are one name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dependencies(pyproject: Path) -> list[str]:
    """``[project] dependencies`` of ``pyproject``, as written."""
    text = pyproject.read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        if block is None:
            raise SystemExit(f"{pyproject}: no [project] dependencies array") from None
        return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    deps: list[str] = tomllib.loads(text)["project"]["dependencies"]
    return deps


def select(deps: list[str], without: set[str], extras: dict[str, str]) -> list[str]:
    """``deps`` minus the names in ``without``; extras replaced as ``extras`` says."""
    out = []
    for dep in deps:
        m = _NAME.match(dep)
        if m is None:
            raise SystemExit(f"cannot read requirement {dep!r}")
        name, extra, rest = m.groups()
        key = canonical(name)
        if key in without:
            continue
        if key in extras:
            extra = f"[{extras[key]}]" if extras[key] else ""
        out.append(f"{name}{extra or ''}{rest}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--without", nargs="*", default=[], metavar="NAME")
    parser.add_argument("--extras", nargs="*", default=[], metavar="NAME=EXTRA,EXTRA")
    args = parser.parse_args(argv)
    extras = {}
    for spec in args.extras:
        name, _, value = spec.partition("=")
        extras[canonical(name)] = value
    deps = dependencies(args.pyproject)
    known = {canonical(_NAME.match(d).group(1)) for d in deps}  # type: ignore[union-attr]
    unknown = ({canonical(n) for n in args.without} | set(extras)) - known
    if unknown:  # a renamed dependency must not silently slip into an image
        raise SystemExit(f"not dependencies of {args.pyproject}: {sorted(unknown)}")
    for line in select(deps, {canonical(n) for n in args.without}, extras):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
