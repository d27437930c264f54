"""Folders whose files become code in this process (native kernel
libraries here; jaxkv's compiled programs and JAX's compilation cache in
`jaxkv.paths`) are used only when no other user can write them.

A shared cache (mode 1777, say) would let anyone plant a library or a
serialized executable that the next run loads, so such a folder is refused
with a warning that names it and says why, and the caller keeps its files
elsewhere (a private temporary folder) or compiles in memory. A folder is
private when it, and each folder above it up to the first that is the
user's home or the filesystem root, is owned by this user (or root) and
not writable by group or others; a sticky folder above (/tmp) counts too,
since others cannot rename what is in it."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def problem(path: str | os.PathLike) -> str | None:
    """Why files under `path` (an existing folder or one to be made) could
    be written by another user; None when it is private."""
    uid = os.getuid()
    p = Path(os.path.abspath(path))
    home = Path(os.path.expanduser("~"))
    first = True
    while True:
        try:
            st = os.stat(p)
        except FileNotFoundError:  # made later, by this user (mkdir honours the umask)
            p, first = p.parent, False
            continue
        except OSError as e:
            return f"{p} cannot be checked ({e.strerror or e})"
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a folder"
        if st.st_uid not in (uid, 0):
            return f"{p} belongs to another user (uid {st.st_uid})"
        if _others_write(st) and (first or not st.st_mode & stat.S_ISVTX):
            return f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
        if p == home or p.parent == p:
            return None
        p, first = p.parent, False


def private_file(path: str | os.PathLike) -> str | None:
    """Why the file at `path` could have been written by another user
    (None: it is this user's, writable by no one else)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path} cannot be checked ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to another user (uid {st.st_uid})"
    if _others_write(st):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _others_write(st: os.stat_result) -> bool:
    """Whether a user other than this one may write it: world-writable, or
    group-writable by a group that is not this user's private group (the
    group of the user's own name and no other member, where umask 002 makes
    every new folder group-writable)."""
    if st.st_mode & stat.S_IWOTH:
        return True
    if not st.st_mode & stat.S_IWGRP:
        return False
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
        g = grp.getgrgid(st.st_gid)
        return not (st.st_gid == os.getgid() and g.gr_name == user and set(g.gr_mem) <= {user})
    except (ImportError, KeyError):
        return True


def secret(path: str | os.PathLike, nbytes: int = 32) -> bytes:
    """The random key in the file at `path`, made on first use (mode 0600,
    its folder 0700). ValueError naming the file when it cannot be made or
    read, holds too few bytes, or another user owns it or may read it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(nbytes))
        bad = private_file(path)
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if bad is None and mode & 0o077:
            bad = f"{path} is readable by other users (mode {mode:o}); remove it to make a new one"
        if bad:
            raise ValueError(bad)
        key = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot be made or read ({e.strerror or e})") from None
    if len(key) < 16:
        raise ValueError(f"{path}: holds {len(key)} bytes, not a key")
    return key
