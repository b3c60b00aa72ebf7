"""What the ``s3`` tier knows about which objects exist, so a lookup need not ask the store.

A serving engine looks every request up before it schedules it (vLLM's scheduler asks on its
own path, per request, often more than once), and without an index each chunk of the prompt
would cost a HEAD request there. ``ExistenceCache`` remembers recent answers:

- *present*: a chunk this process stored, read, or found with a HEAD; kept ``present_ttl_s``
  (another replica or a lifecycle rule may delete it: then the read that follows is a 404, a
  miss, and the answer is corrected);
- *absent*: a chunk a HEAD or a GET found missing; kept only ``absent_ttl_s``, because another
  replica may store it any moment (a stale "absent" costs one recompute, never a wrong byte).

At most ``capacity`` keys are kept, least recently answered first out. It is thread-safe: the
engine's loop writes it, lookups on callers' threads read it (``batched_contains_nowait``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class ExistenceCache:
    """Recent existence answers per key (see the module docstring); ``capacity`` 0 turns it off."""

    def __init__(self, capacity: int, present_ttl_s: float, absent_ttl_s: float) -> None:
        self.capacity = capacity
        self.present_ttl_s = present_ttl_s
        self.absent_ttl_s = absent_ttl_s
        self._answers: OrderedDict[Hashable, tuple[bool, float]] = OrderedDict()  # key -> (exists, expires at)
        self._lock = threading.Lock()
        self.answered = 0  # keys answered from memory (each one a request saved)

    def record(self, keys: Iterable[Hashable], exists: bool) -> None:
        """``keys`` were just seen to exist (stored, read, HEAD 200) or not (HEAD or GET 404)."""
        if not self.capacity:
            return
        expires = time.monotonic() + (self.present_ttl_s if exists else self.absent_ttl_s)
        with self._lock:
            for key in keys:
                self._answers[key] = (exists, expires)
                self._answers.move_to_end(key)
            while len(self._answers) > self.capacity:
                self._answers.popitem(last=False)

    def known(self, keys: Sequence[Hashable]) -> list[bool | None]:
        """Whether each key exists, as far as a fresh answer says (None: not known)."""
        now = time.monotonic()
        result: list[bool | None] = []
        with self._lock:
            for key in keys:
                answer = self._answers.get(key)
                if answer is None or answer[1] <= now:
                    result.append(None)
                    continue
                result.append(answer[0])
            self.answered += sum(answer is not None for answer in result)
        return result

    def answer(self, keys: Sequence[Hashable]) -> list[bool] | None:
        """Every key's existence when all of them are known, else None (nothing is counted)."""
        now = time.monotonic()
        with self._lock:
            answers = [self._answers.get(key) for key in keys]
            if any(answer is None or answer[1] <= now for answer in answers):
                return None
            self.answered += len(keys)
            return [answer[0] for answer in answers if answer is not None]

    def __len__(self) -> int:
        return len(self._answers)
