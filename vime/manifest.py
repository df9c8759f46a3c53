"""A checkpoint's manifest: the size and SHA-256 of every file, written at save, checked before use.

`write_manifest(directory)` records every file under `directory` (`manifest.json` beside them);
`manifest_problem(directory)` says, in a few words, the first file that is missing, has another
size or another checksum than recorded, or None when all hold. Whatever damaged a file (a
truncated write, a full disk, a copy cut short, a flipped bit), the checkpoint is refused before a
loader reads it, instead of failing inside one with its own traceback. The files are hashed on a
few threads (hashlib releases the GIL), so a verify costs about one read of the checkpoint
(BENCHMARKS.md, checkpoint manifest).

    python -m vime.manifest write DIR   # a manifest for a checkpoint you trust that has none
    python -m vime.manifest check DIR   # what `--load` checks
"""
import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

from vime.errors import UserError, exit_on_user_error, require
from vime.paths import require_dir

MANIFEST = "manifest.json"
CHUNK = 1 << 20
WRITE_COMMAND = "python -m vime.manifest write"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_all(paths):
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_of, paths))


def files_under(directory):
    """Every regular file under `directory` (but the manifest), as paths relative to it, sorted."""
    found = []
    for parent, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), directory)
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def write_manifest(directory):
    """Record the size and SHA-256 of every file under `directory` in its manifest.json (fsynced). A
    symbolic link counts as the file it points to; one that points nowhere is one line (a manifest
    cannot vouch for a file that is not there)."""
    rel = files_under(directory)
    paths = [os.path.join(directory, r) for r in rel]
    dangling = next(((r, p) for r, p in zip(rel, paths) if not os.path.exists(p)), None)
    if dangling is not None:
        raise UserError(f"{directory}: {dangling[0]} is a symbolic link to {os.readlink(dangling[1])}, which does not "
                        "exist; restore what it points to or remove it, then write the manifest")
    files = {r: {"bytes": os.path.getsize(p), "sha256": h} for r, p, h in zip(rel, paths, _hash_all(paths))}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def read_manifest(directory):
    """{relative path: {"bytes", "sha256"}} of `directory`'s manifest, or a string saying why there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return (f"{MANIFEST} is missing (a checkpoint of an older vime, or not one vime wrote; for one you "
                f"trust, `{WRITE_COMMAND} {directory}` writes it)")
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        require(isinstance(files, dict) and all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                                                and isinstance(v.get("sha256"), str) for v in files.values()), "")
    except Exception:  # any damage to the manifest itself
        return f"{MANIFEST} is damaged"
    return files


def manifest_problem(directory):
    """None when every file the manifest of `directory` lists is there with its size and checksum,
    else the first disagreement in a few words (sizes are compared before any file is hashed)."""
    files = read_manifest(directory)
    if isinstance(files, str):
        return files
    for rel, want in files.items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        have = os.path.getsize(path)
        if have != want["bytes"]:
            return f"{rel} has {have} bytes, the manifest says {want['bytes']}"
    names = list(files)
    for rel, digest in zip(names, _hash_all([os.path.join(directory, r) for r in names])):
        if digest != files[rel]["sha256"]:
            return f"{rel} differs from its checksum in the manifest (its bytes changed after the save)"
    return None


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vime.manifest", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("write", "check"))
    p.add_argument("directory")
    args = p.parse_args(argv)
    require_dir(args.directory, None)
    if args.action == "write":
        try:
            write_manifest(args.directory)
        except OSError as e:  # a file it may not read: one line naming it
            raise UserError(f"{args.directory}: cannot read {e.filename} ({e.strerror}); a manifest needs every "
                            "file's bytes") from None
        print(f"wrote {os.path.join(args.directory, MANIFEST)} ({len(files_under(args.directory))} files)")
        return
    problem = manifest_problem(args.directory)
    require(problem is None, f"{args.directory}: {problem}")
    print(f"{args.directory}: every file matches its manifest")


if __name__ == "__main__":
    main()
