"""The user's frame: the first Python frame whose file lies outside some folders (torch's, rotor's).

Messages name the user's `file:line` (a checkpoint call, a branch on a tensor value). A file is inside a folder
when the folder is one of its parent directories, compared by path components: torch's folder
`.../site-packages/torch` does not hold `.../site-packages/torchvision/` nor `.../site-packages/torchtitan/`,
which a string prefix would say it does (and their frames would be skipped as torch's).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import FrameType


def in_folder(path: str, folder: str) -> bool:
    """Whether the file `path` lies in `folder` or below it (both made absolute first)."""
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # on different drives (Windows)
        return False


def first_outside(frame: FrameType | None, folders: Sequence[str]) -> FrameType | None:
    """`frame` or the first frame it was called from whose file lies in none of `folders`; None if none does."""
    while frame is not None and any(in_folder(frame.f_code.co_filename, f) for f in folders):
        frame = frame.f_back
    return frame
