"""A progress bar on stderr: tqdm when installed (the `bench` extra), else a one-line counter."""

from __future__ import annotations

import sys
import time


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Counter(_Silent):
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.note = total, desc, 0, ""
        self.t0 = time.perf_counter()
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def set_postfix_str(self, text: str) -> None:
        self.note = text
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _draw(self) -> None:
        elapsed = time.perf_counter() - self.t0
        line = f"\r{self.desc}: {self.done}/{self.total} [{elapsed:.0f}s] {self.note}"
        sys.stderr.write(line[:120].ljust(120))
        sys.stderr.flush()


def progress(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="step", leave=False, dynamic_ncols=True)
