"""Remote names (S3 keys, shard names from a checkpoint's index, revisions) never become local paths outside the
folder they are joined onto: every such join goes through :func:`confined_path`."""

from __future__ import annotations

from pathlib import Path
from typing import Union


def unsafe_parts(relative: str) -> list[str]:
    """The parts of a ``/``-separated remote name that would make it leave the folder it is joined onto: ``..``
    and ``.`` segments, and a leading ``/`` (an absolute name). Empty for a name that stays where it is put."""
    parts = [part for part in relative.split("/") if part in ("..", ".")]
    return ["/", *parts] if relative.startswith("/") else parts


def confined_path(root: Union[str, Path], relative: Union[str, Path], resolve: bool = True) -> Path:
    """``root / relative``, checked to stay inside ``root``: ValueError when it does not.

    A remote name (an S3 key, a shard named by a checkpoint's index, an adapter's name) never becomes a local path
    without this. With ``resolve`` (the default) both sides are resolved first, so ``..`` segments and symlinks
    anywhere on the way are followed before the check; ``resolve=False`` checks the name alone (no ``..``, ``.``,
    not absolute) for folders whose files are symlinks by design (a Hugging Face snapshot links into its blobs).
    """
    text = str(relative)
    bad = unsafe_parts(text.replace("\\", "/"))
    if not text or (bad and not resolve):
        raise ValueError(f"{text!r} is not a plain relative name ({', '.join(repr(b) for b in bad) or 'empty'})")
    base = Path(root)
    if not resolve:
        return base / text
    inside = base.resolve()
    path = (inside / text).resolve()
    if path != inside and not path.is_relative_to(inside):
        raise ValueError(f"{text!r} leads outside {str(base)!r} (to {str(path)!r})")
    return path
