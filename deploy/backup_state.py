"""Back up a coordinator's state directory while the coordinator runs (docs/deploy.md, "Backups").

    python deploy/backup_state.py STATE_DIR DEST     # in the image: fedtrain-backup STATE_DIR DEST

DEST (new, or empty) receives a copy that a coordinator resumes from (`fedtrain coordinator
--state-dir DEST`), at the version committed when the backup began. The order matters:

1. The database first, with SQLite's online backup API (what `sqlite3 run.db ".backup F"`
   does): a consistent copy even while the coordinator writes, and one file (no -wal/-shm).
   It names the committed version N. A version's checkpoint files are written (and renamed
   into place) before its row commits, so N's files are on disk once the database says N.
2. Then the checkpoint files (global-N, outer-N and the other kept versions). The coordinator
   goes on committing meanwhile and removes versions past `keep_checkpoints`, or writes a new
   version into an old file, so each file is copied and then checked: the same file (inode,
   size, modification time) before and after the copy, else it is copied again or, for a
   version other than N, left out. Copied the other way round (files, then the database) the
   database could name a version whose files are not in the copy.
3. The token files the coordinator keeps, mode 600 like the originals: admin-token, a first
   site's participant-tokens/*.token, and an older state dir's tokens.json. (Minted per-site
   tokens are in the database, as their sha256.)

Left out: the lock, endpoint.json, the upload spool and temp files (a restored coordinator
makes them again; uploads in flight are sent again by their participants).
Stdlib only; exits 1 with one line when the backup cannot be made.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import sys
from pathlib import Path

DB = "run.db"
CHECKPOINTS = "checkpoints"
TOKENS = ("admin-token", "tokens.json")  # and participant-tokens/*.token
SITE_TOKENS = "participant-tokens"
CHECKPOINT_NAME = re.compile(r"^(global|outer)-(\d{6,})\.safetensors$")
ATTEMPTS = 5


class BackupError(Exception):
    pass


def backup_database(source: Path, dest: Path) -> int:
    """SQLite's online backup of `source` into `dest`; returns the committed version it holds."""
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    try:
        out = sqlite3.connect(dest)
        try:
            src.backup(out)
            row = out.execute("SELECT value FROM meta WHERE key = 'global_version'").fetchone()
        finally:
            out.close()
    except sqlite3.Error as e:
        raise BackupError(f"{source}: {e}") from None
    finally:
        src.close()
    if row is None:
        raise BackupError(f"{source} holds no committed version (is it a fedtrain state directory?)")
    return int(row[0])


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def copy_unchanged(source: Path, dest: Path) -> bool:
    """Copy `source` to `dest`; True when the file stayed the same file, unwritten, throughout."""
    before = _identity(source)
    if before is None:
        return False
    try:
        shutil.copyfile(source, dest)
    except FileNotFoundError:
        return False
    return _identity(source) == before


def backup(state_dir: Path, dest: Path) -> tuple[int, list[str]]:
    """Back up `state_dir` into `dest`; returns the committed version and the files copied."""
    if not (state_dir / DB).is_file():
        raise BackupError(f"{state_dir} is not a coordinator's state directory (no {DB})")
    if dest.exists() and any(dest.iterdir()):
        raise BackupError(f"{dest} is not empty: back up into a new directory")
    (dest / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    version = backup_database(state_dir / DB, dest / DB)
    copied = [DB]
    names = sorted(p.name for p in (state_dir / CHECKPOINTS).iterdir() if CHECKPOINT_NAME.match(p.name))
    needed = {f"global-{version:06d}.safetensors", f"outer-{version:06d}.safetensors"}
    if version > 0 and not needed <= set(names):
        raise BackupError(f"the files of the committed version {version} are not in {state_dir / CHECKPOINTS}")
    for name in sorted(names, key=lambda n: n not in needed):  # version N's files first
        match = CHECKPOINT_NAME.match(name)
        if match is None or int(match.group(2)) > version:
            continue  # newer than the database copy: that copy would not know them
        for _ in range(ATTEMPTS):
            if copy_unchanged(state_dir / CHECKPOINTS / name, dest / CHECKPOINTS / name):
                copied.append(f"{CHECKPOINTS}/{name}")
                break
        else:
            (dest / CHECKPOINTS / name).unlink(missing_ok=True)
            if name in needed:
                raise BackupError(f"{name} kept changing while it was copied: run the backup again")
    sites = sorted((state_dir / SITE_TOKENS).glob("*.token")) if (state_dir / SITE_TOKENS).is_dir() else []
    for path in [*(state_dir / name for name in TOKENS), *sites]:
        if path.is_file():
            name = str(path.relative_to(state_dir))
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(path.read_bytes())
            copied.append(name)
    return version, copied


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: backup_state.py STATE_DIR DEST", file=sys.stderr)
        return 2
    try:
        version, copied = backup(Path(argv[0]), Path(argv[1]))
    except (BackupError, OSError) as e:
        print(f"fedtrain backup: error: {e}", file=sys.stderr)
        return 1
    print(f"fedtrain backup: version {version} of {argv[0]} in {argv[1]} ({len(copied)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
