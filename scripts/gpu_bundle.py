"""Build and use the offline GPU bundle (called by ``scripts/fetch_gpu_wheels.sh`` and ``scripts/gpu_smoke.sh``).

``build`` (where PyPI is reachable): resolve, for the GPU image's Python (3.12, manylinux x86_64, binary
wheels only), everything the image lacks -- bitsandbytes, liger-kernel, hydra-core + omegaconf +
antlr4-python3-runtime (sdist only: built into a wheel here), optuna + its dependencies, nvidia-ml-py and the
Unsloth stack (unsloth, unsloth_zoo, trl, datasets<5, tyro, torchao, cut_cross_entropy, msgspec, ...) --
against what the image already has (torch 2.11, triton 3.6, transformers 5.17, peft 0.21 and their
dependencies). torch/triton/torchvision/xformers are stood in for by empty local wheels during the
resolution, so nothing CUDA-sized is downloaded. The wheels are unzipped into one folder, trimmed
(bitsandbytes keeps only its CUDA 13.0 library, unsloth loses ``studio/``, its 82 MB web UI), a
``BUNDLE.json`` manifest lists each distribution with its files, and the folder is packed as one
``gpu_bundle.tar.xz`` (refused above ``--max-mib``).

``verify`` (anywhere, before a loan): find the packed bundle (``$VRAMSWEEP_GPU_BUNDLE``, ``wheels/``, the shared
prebuilt copy) and check its ``BUNDLE.json`` against :data:`WANTED`; ``gpu_smoke.sh --dry-run`` prints it.

``activate DIR`` (on the GPU box, run with the image's Python *before* DIR is on the path): every bundled
distribution that the image already has is moved out of DIR to ``DIR.shadowed/`` (the image's copy wins;
PYTHONPATH puts DIR first), and the kept ones are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

#: What the image does not have (issue 10), with versions compatible with transformers 5.17 / peft 0.21.
WANTED = [
    "bitsandbytes==0.50.2",
    "liger-kernel==0.8.5",
    "nvidia-ml-py==13.615.71",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "antlr4-python3-runtime==4.9.3",
    "optuna==5.0.0",
    "sqlalchemy==2.1.9",
    "unsloth==2026.10.9",
    "unsloth_zoo==2026.10.9",
    "trl==1.15.0",
    # transitive, pinned (issue 37.3): what the fork server imports (transformers imports torchao when it is
    # importable) and the data stack must not change with a rebuild
    "datasets==4.8.5",
    "torchao==0.18.0",
    "pyarrow==26.0.1",
]
#: The image: these and their whole dependency closure are never bundled.
IMAGE = ["torch==2.11.0+image", "triton==3.6.0+image", "transformers==5.17.0", "peft==0.21.0"]
#: Empty stand-ins (``+image`` local versions) so the resolver never downloads a CUDA stack.
STANDINS = {
    "torch": "2.11.0+image",
    "triton": "3.6.0+image",
    "torchvision": "0.26.0+image",
    "xformers": "0.0.99+image",
}
#: Requirements of unsloth that it does not import for causal-LM training (optional at run time) and that
#: would cost bundle space: left out. xformers: Unsloth falls back to SDPA/flash; diffusers: image models.
SKIP = {"torchvision", "xformers", "diffusers", "hf-transfer", "torchaudio"}
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "linux_x86_64",
    "any",
]
BNB_KEEP_CUDA = "cuda130"
MANIFEST = "BUNDLE.json"
BUNDLE_FILE = "gpu_bundle.tar.xz"
#: The project root (the working tree a device run carries).
ROOT = Path(__file__).resolve().parents[1]


#: Files dropped from the bundle, per distribution (glob patterns on the wheel path), on top of test suites.
TRIM = {
    "unsloth": ["studio/*"],  # the 82 MB web UI
    "unsloth-zoo": ["unsloth_zoo/mlx/*"],  # Apple MLX only
    # every GPU library but BNB_KEEP_CUDA's (other CUDA versions, ROCm, XPU); the CPU one stays
    "bitsandbytes": [
        "bitsandbytes/libbitsandbytes_cuda*",
        "bitsandbytes/libbitsandbytes_rocm*",
        "bitsandbytes/libbitsandbytes_xpu*",
    ],
    "pyarrow": [
        "pyarrow/include/*",
        "pyarrow/includes/*",
        "pyarrow/src/*",
        "pyarrow/*.pxd",
        "pyarrow/*.pyx",
        "pyarrow/*.pxi",
        "pyarrow/*flight*",
        "pyarrow/*s3*",
        "pyarrow/*gandiva*",
        "pyarrow/*cpp_tests*",
        "pyarrow/libarrow_python*.so",
        "pyarrow/*.so.*.*.*",
    ],  # C++ headers/Cython sources, link-time aliases of libarrow_python (every module NEEDs *.so.2600);
    # Flight RPC and S3 (only pyarrow.flight / pyarrow._s3fs load them, lazily; datasets uses fsspec)
}


def trimmed_away(dist: str, path: str) -> bool:
    """True for a wheel file that is not needed at run time (kept: bitsandbytes' cuda130 library)."""
    import fnmatch

    parts = path.split("/")
    if any(p in ("tests", "test") for p in parts[:-1]) and not parts[0].endswith(".dist-info"):
        return True  # test suites (pandas/tests, pyarrow/tests, torchao's top-level test/)
    if dist == "bitsandbytes" and BNB_KEEP_CUDA in parts[-1]:
        return False
    return any(fnmatch.fnmatch(path, pat) for pat in TRIM.get(dist, []))


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _standin(dest: Path, name: str, version: str) -> None:
    di = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{di}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: vramsweep\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{di}/RECORD", "")


def _pip(args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"gpu_bundle: pip failed (exit {rc}); see {log}")


def resolve(
    reqs: list[str], links: list[Path], pyver: str, work: Path, tag: str, log: Path
) -> dict[str, str]:
    """``{normalised name: version}`` of the closure of ``reqs`` for the target Python/platform."""
    report = work / f"report-{tag}.json"
    args = [
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        "--target",
        str(work / "t"),
        "--python-version",
        pyver,
        "--only-binary=:all:",
    ]
    for p in PLATFORMS:
        args += ["--platform", p]
    for link in links:
        args += ["--find-links", str(link)]
    _pip(args + reqs, log)
    data = json.loads(report.read_text())
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}


def build(args: argparse.Namespace) -> int:
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_bundle_", dir=dest))
    log = dest / "gpu_bundle.log"
    log.write_text("")
    t0 = time.time()
    stand = work / "standins"
    stand.mkdir()
    for name, version in STANDINS.items():
        _standin(stand, name, version)
    built = work / "built"  # antlr4-python3-runtime 4.9.3 is an sdist only: build its pure-Python wheel
    print("gpu_bundle: building antlr4-python3-runtime 4.9.3 from its sdist", flush=True)
    _pip(["wheel", "--no-deps", "--quiet", "-w", str(built), "antlr4-python3-runtime==4.9.3"], log)
    links = [stand, built]
    pins = [f"{n}=={v}" for n, v in STANDINS.items()]
    print("gpu_bundle: resolving the image and the bundle for Python " + args.python_version, flush=True)
    image = resolve(IMAGE, links, args.python_version, work, "image", log)
    full = resolve(WANTED + IMAGE + pins, links, args.python_version, work, "full", log)
    drop = set(image) | {norm(n) for n in STANDINS} | {norm(n) for n in SKIP}
    bundle = {n: v for n, v in sorted(full.items()) if n not in drop}
    for name, version in image.items():
        if name in full and full[name] != version:
            print(
                f"gpu_bundle: note: {name} resolves to {full[name]} with the bundle, {version} in the image"
            )
    wheels = work / "wheels"
    print(
        f"gpu_bundle: downloading {len(bundle)} wheels: " + ", ".join(f"{n}=={v}" for n, v in bundle.items()),
        flush=True,
    )
    dl = [
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(wheels),
        "--python-version",
        args.python_version,
        "--only-binary=:all:",
        "--find-links",
        str(built),
    ]
    for p in PLATFORMS:
        dl += ["--platform", p]
    _pip(dl + [f"{n}=={v}" for n, v in bundle.items()], log)
    site = work / "site"
    site.mkdir()
    manifest: dict[str, dict] = {}
    trimmed: list[str] = []
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            di = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
            meta = z.read(f"{di}/METADATA").decode(errors="replace")
            dist = next(
                line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Name:")
            )
            version = next(
                line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:")
            )
            keep = []
            for n in names:
                if n.split("/")[0].endswith(".data"):
                    continue  # scripts/headers: not needed on PYTHONPATH
                if trimmed_away(norm(dist), n):
                    trimmed.append(n)
                    continue
                keep.append(n)
            for n in keep:
                z.extract(n, site)
        tops = sorted({n.split("/")[0] for n in keep})
        manifest[norm(dist)] = {"dist": dist, "version": version, "wheel": whl.name, "top": tops}
    (site / MANIFEST).write_text(
        json.dumps({"python": args.python_version, "wanted": WANTED, "dists": manifest}, indent=1) + "\n"
    )
    out = dest / BUNDLE_FILE
    tmp = out.with_suffix(".tmp")
    print("gpu_bundle: packing (xz -9: gzip -9 would be 77 MiB, over the limit; takes minutes)", flush=True)
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        tar.add(site, arcname="gpu_bundle")
    size = tmp.stat().st_size
    unpacked = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    ok, text = carry_check(ROOT, size, args.max_mib)
    print(f"gpu_bundle: {text}")
    if not ok:
        tmp.unlink()
        print(f"gpu_bundle: not written (see {log})", file=sys.stderr)
        return 1
    tmp.replace(out)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"gpu_bundle: trimmed {len(trimmed)} files (bitsandbytes non-{BNB_KEEP_CUDA} libraries, unsloth studio/)"
    )
    print(
        f"gpu_bundle: {len(manifest)} distributions: "
        + ", ".join(f"{m['dist']} {m['version']}" for m in manifest.values())
    )
    print(
        f"gpu_bundle: wrote {out} ({size / 2**20:.1f} MiB packed, {unpacked / 2**20:.1f} MiB unpacked) in {time.time() - t0:.0f} s"
    )
    return 0


def tree_bytes(root: Path) -> int:
    """Bytes of what a device run carries of the working tree: tracked files plus untracked files git
    does not ignore (``git ls-files --cached --others --exclude-standard``); ignored paths travel only
    when named (the bundle)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    total = 0
    for name in {n for n in out.split("\0") if n}:
        path = root / name
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def carry_check(root: Path, bundle_bytes: int, max_mib: float = 64.0) -> tuple[bool, str]:
    """Whether the working tree + the bundle fit what a device run carries (``max_mib`` in all)."""
    tree = tree_bytes(root)
    total = tree + bundle_bytes
    verdict = "fits" if total <= max_mib * 2**20 else "does NOT fit"
    return total <= max_mib * 2**20, (
        f"carried: tree {tree / 2**20:.1f} MiB + bundle {bundle_bytes / 2**20:.1f} MiB = "
        f"{total / 2**20:.1f} MiB: {verdict} in {max_mib:g} MiB"
    )


def check(args: argparse.Namespace) -> int:
    """``check``: the tree + an existing bundle against the carry limit (exit 1 when over)."""
    bundle = Path(args.bundle)
    size = bundle.stat().st_size if bundle.is_file() else 0
    ok, text = carry_check(ROOT, size, args.max_mib)
    print(f"gpu_bundle: {text}" + ("" if bundle.is_file() else f" (no bundle at {bundle})"))
    return 0 if ok else 1


#: Where a prebuilt bundle is looked for, in order (after ``$VRAMSWEEP_GPU_BUNDLE``): the checkout's git-ignored
#: ``wheels/`` (carried to a device run by naming it), then the team's shared prebuilt copy (a ``shared/``
#: folder in the checkout, or the one beside it).
BUNDLE_PLACES = ("wheels", "shared/gpu-bundle", "../shared/gpu-bundle")


def find_bundle(root: Path = ROOT, explicit: str | None = None) -> Path | None:
    """The bundle to use: ``explicit`` (or ``$VRAMSWEEP_GPU_BUNDLE``) if given, else the first of
    :data:`BUNDLE_PLACES` under ``root`` that holds :data:`BUNDLE_FILE`; None when there is none."""
    import os

    explicit = explicit or os.environ.get("VRAMSWEEP_GPU_BUNDLE") or None
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    for place in BUNDLE_PLACES:
        path = (root / place / BUNDLE_FILE).resolve()
        if path.is_file():
            return path
    return None


def read_manifest(bundle: Path) -> dict:
    """``BUNDLE.json`` of a packed bundle, read by streaming the archive up to it (it is packed first, so
    this costs milliseconds, not the minute a full extraction takes)."""
    with tarfile.open(bundle, "r|*") as tar:
        for member in tar:
            if member.name == f"gpu_bundle/{MANIFEST}":
                fh = tar.extractfile(member)
                if fh is not None:
                    return json.loads(fh.read())
    raise ValueError(f"{bundle}: no gpu_bundle/{MANIFEST} in the archive")


def manifest_mismatches(manifest: dict, wanted: list[str] | None = None) -> list[str]:
    """What does not match between a bundle's manifest and ``wanted`` (default :data:`WANTED`): a wanted
    distribution missing or in a version outside its specifier, and (for a manifest that records the list it
    was built from) a differing list. Empty when the bundle is what today's WANTED list builds."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    wanted = list(WANTED if wanted is None else wanted)
    dists = manifest.get("dists") or {}
    out = []
    for line in wanted:
        req = Requirement(line)
        info = dists.get(norm(req.name))
        if info is None:
            out.append(f"{req.name}: wanted {req.specifier or 'any'}, not in the bundle")
            continue
        try:
            ok = req.specifier.contains(Version(info["version"]), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            out.append(f"{req.name}: wanted {req.specifier}, bundle has {info['version']}")
    recorded = manifest.get("wanted")
    if recorded is not None and sorted(recorded) != sorted(wanted):
        gone, new = sorted(set(recorded) - set(wanted)), sorted(set(wanted) - set(recorded))
        out.append(f"built from another WANTED list (not wanted now: {gone or '-'}; new: {new or '-'})")
    return out


def verify(args: argparse.Namespace) -> int:
    """``verify``: find the bundle and check its manifest against WANTED (exit 0 when it matches, 1 when it
    does not, 3 when there is no bundle); one line per finding, for the smoke's ``--dry-run`` to print."""
    root = Path(args.root).resolve()
    bundle = find_bundle(root, args.bundle)
    if bundle is None:
        where = args.bundle or ", ".join(f"{p}/{BUNDLE_FILE}" for p in BUNDLE_PLACES)
        print(f"gpu_bundle: NO bundle ({where}); build it: bash scripts/fetch_gpu_wheels.sh (~15 min of CPU)")
        return 3
    try:
        manifest = read_manifest(bundle)
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"gpu_bundle: bundle {bundle} unreadable: {exc}")
        return 1
    bad = manifest_mismatches(manifest)
    size = bundle.stat().st_size / 2**20
    head = f"gpu_bundle: bundle {bundle} ({size:.1f} MiB, {len(manifest.get('dists') or {})} distributions)"
    if bad:
        print(f"{head}: manifest does NOT match scripts/gpu_bundle.py's WANTED list; rebuild it:")
        for line in bad:
            print(f"gpu_bundle:   {line}")
        return 1
    print(f"{head}: manifest matches scripts/gpu_bundle.py's WANTED list ({len(WANTED)} requirements)")
    if args.print_path:
        print(f"BUNDLE={bundle}")
    return 0


def bundle_requirements(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """``{name: [(requiring dist, specifier), ...]}`` from the Requires-Dist of every bundled distribution
    (markers evaluated for the running Python; extras ignored)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: dict[str, list[tuple[str, str]]] = {}
    for meta in folder.glob("*.dist-info/METADATA"):
        owner = meta.parent.name.split("-")[0]
        for line in meta.read_text(errors="replace").splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            try:
                req = Requirement(line.split(":", 1)[1].strip())
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if str(req.specifier):
                out.setdefault(norm(req.name), []).append((owner, str(req.specifier)))
    return out


def activate(args: argparse.Namespace) -> int:
    """Move out of ``DIR`` every bundled distribution the running (image) Python already has in a version
    that satisfies what the bundle requires of it (so the image's copy wins); a distribution the image lacks,
    or has in a version the bundle cannot use (e.g. datasets 5 where unsloth needs <5), is taken from DIR."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    folder = Path(args.dir)
    data = json.loads((folder / MANIFEST).read_text())
    needs = bundle_requirements(folder)
    shadow = folder.with_name(folder.name + ".shadowed")
    forced = {norm(n) for n in args.force}
    kept, skipped = [], []
    for key, info in data["dists"].items():
        try:
            have = metadata.version(info["dist"])
        except metadata.PackageNotFoundError:
            have = None
        if have is None or key in forced:
            kept.append(f"{info['dist']} {info['version']}")
            continue
        bad = []
        for owner, spec in needs.get(key, []):
            try:
                if not SpecifierSet(spec).contains(Version(have), prereleases=True):
                    bad.append(f"{owner} needs {spec}")
            except InvalidVersion:
                bad.append(f"unparsable version {have}")
        if bad:
            kept.append(f"{info['dist']} {info['version']} (image has {have}; {', '.join(bad)})")
            continue
        skipped.append(f"{info['dist']} (image has {have})")
        shadow.mkdir(exist_ok=True)
        for top in info["top"]:
            src = folder / top
            if src.exists():
                shutil.move(str(src), str(shadow / top))
    print(f"gpu_bundle: using from the bundle: {', '.join(kept) or 'nothing'}")
    if skipped:
        print(f"gpu_bundle: the image's own copy wins: {', '.join(skipped)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bundle", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--dest", default="wheels")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--max-mib", type=float, default=64.0)
    b.add_argument("--keep-work", action="store_true")
    a = sub.add_parser("activate")
    a.add_argument("dir")
    a.add_argument("--force", nargs="*", default=[], help="distributions to take from the bundle anyway")
    c = sub.add_parser("check", help="the tree + the bundle against the device run's carry limit")
    c.add_argument("--bundle", default=str(ROOT / "wheels" / BUNDLE_FILE))
    c.add_argument("--max-mib", type=float, default=64.0)
    v = sub.add_parser("verify", help="find the bundle and check its manifest against WANTED")
    v.add_argument("--bundle", default=None, help="this file instead of the usual places")
    v.add_argument("--root", default=str(ROOT))
    v.add_argument("--print-path", action="store_true", help="also print BUNDLE=<path> when it matches")
    args = p.parse_args(argv)
    return {"build": build, "activate": activate, "check": check, "verify": verify}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
