"""Stop strings split across tokens are found, never emitted, and hold back no more than needed."""

from lathe.serve.stop import StopMatcher


def stream(stop, pieces):
    matcher = StopMatcher(stop)
    out = [matcher.feed(p) for p in pieces]
    return out, matcher


def test_stop_string_split_across_tokens_is_cut_and_not_emitted():
    out, matcher = stream(["\n\nUser:"], ["Hello", " there", "\n", "\nUs", "er:", " more"])
    assert "".join(out) == "Hello there" and matcher.stopped
    assert out == ["Hello", " there", "", "", "", ""]


def test_partial_match_that_fails_is_released():
    out, matcher = stream(["END"], ["an E", "N", "x", " done"])
    assert out == ["an ", "", "ENx", " done"] and not matcher.stopped
    assert matcher.flush() == ""


def test_earliest_of_several_stop_strings_wins_and_flush_releases_the_tail():
    out, matcher = stream(["bb", "abc"], ["xab", "cbb"])
    assert "".join(out) == "x" and matcher.stopped
    out, matcher = stream(["STOP"], ["the end ST"])
    assert out == ["the end "] and matcher.flush() == "ST"
