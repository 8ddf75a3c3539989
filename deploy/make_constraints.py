"""Write deploy/constraints.txt: exact pins for the Mosaic image's runtime dependencies.

The set is the dependency closure of `mosaic-serve[k8s]` (the gateway's Kubernetes discovery and the
autoscaler's actuator need the `kubernetes` client), resolved from what is installed in the current
environment, i.e. `pip freeze` restricted to what the runtime needs (no pytest, ruff, helm SDK ...).
Environment markers are evaluated for this interpreter, so run it with the Python the image uses:

    .venv/bin/python deploy/make_constraints.py            # rewrites deploy/constraints.txt
    .venv/bin/python deploy/make_constraints.py --check    # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "mosaic-serve"
EXTRAS = ("k8s",)
OUT = Path(__file__).resolve().parent / "constraints.txt"
HEADER = (
    "# Runtime pins for the Mosaic image (deploy/Dockerfile): the dependency closure of\n"
    f"# {PROJECT}[{','.join(EXTRAS)}] as installed in the dev environment. Regenerate with\n"
    "#   .venv/bin/python deploy/make_constraints.py\n"
)


def _requirements(dist: metadata.Distribution, extras: tuple[str, ...]) -> list[Requirement]:
    wanted = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None:
            wanted.append(req)
            continue
        # A requirement applies if its marker holds with no extra, or with one of the extras asked for.
        if any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            wanted.append(req)
    return wanted


def closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """Canonical name → installed version for every distribution the project needs at run time."""
    pins: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(project, extras)]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, wanted_extras = todo.pop()
        if (name, wanted_extras) in seen:
            continue
        seen.add((name, wanted_extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is required but not installed in {sys.prefix}") from None
        key = canonicalize_name(dist.metadata["Name"])
        if key != canonicalize_name(project):
            pins[key] = dist.version
        for req in _requirements(dist, wanted_extras):
            todo.append((req.name, tuple(sorted(req.extras))))
    return dict(sorted(pins.items()))


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when constraints.txt differs")
    args = parser.parse_args()
    text = render(closure())
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date; run: python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({text.count('==')} pins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
