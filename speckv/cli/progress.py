"""Progress display on stderr (rich), silent for ``--json`` runs."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def steps(total: int, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A bar of ``total`` named steps; call the yielded function to start the next one."""
    if quiet:
        yield lambda _desc: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=False)
    task = progress.add_task("starting", total=total)
    started = [0]

    def step(desc: str) -> None:
        if started[0]:
            progress.advance(task)
        started[0] += 1
        progress.update(task, description=desc)

    with progress:
        yield step
        progress.update(task, completed=total, description="done")
