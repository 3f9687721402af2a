"""rank_print: a rank prefix, rank 0 only by default, one write per line."""

import pytest

from ddpguide.core.ranklog import rank_print


class _Writes:
    """A stream that keeps each ``write`` call apart."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("kwargs, line", [
    ({}, "[rank 3] loss 0.5\n"),
    ({"sep": "", "end": ""}, "[rank 3]loss0.5"),
    ({"sep": None, "end": None}, "[rank 3] loss 0.5\n"),
    ({"sep": ", ", "end": "!\n"}, "[rank 3], loss, 0.5!\n"),
])
def test_rank_print_writes_each_line_at_once_like_print(monkeypatch, kwargs, line):
    monkeypatch.setenv("RANK", "3")
    stream = _Writes()
    rank_print("loss", 0.5, all_ranks=True, file=stream, **kwargs)
    assert stream.calls == [line]  # one write: no other rank's output can land inside it
    rank_print("only rank 0 prints this", file=stream)
    assert stream.calls == [line]
