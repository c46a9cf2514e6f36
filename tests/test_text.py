from localspec.text import TextAssembler

PIECES = {
    1: b"Hello",
    2: b" w",
    3: b"orld",
    4: "é".encode()[:1],  # first byte of a 2-byte character
    5: "é".encode()[1:],  # its second byte
    6: "😀".encode()[:2],
    7: "😀".encode()[2:],
    8: b"STO",
    9: b"P!",
    10: b" end",
    11: b"\xff",  # invalid on its own
}


def run(tokens, stop=()):
    a = TextAssembler(PIECES.__getitem__, stop)
    chunks = [a.push(t) for t in tokens]
    chunks.append(a.finish())
    return a, chunks


def test_concatenation_is_exact_with_split_utf8():
    toks = [1, 4, 5, 6, 7, 2, 3]
    a, chunks = run(toks)
    assert "".join(chunks) == a.text == "Helloé😀 world"
    # the first byte of é releases nothing; the second releases the character
    assert chunks[1] == "" and chunks[2] == "é"
    assert chunks[3] == "" and chunks[4] == "😀"


def test_stop_string_across_tokens_cuts_text_and_tokens():
    a, chunks = run([1, 2, 8, 9, 10], stop=["STOP"])
    assert a.text == "Hello w"
    assert "".join(chunks) == a.text
    assert a.stop_hit.stop == "STOP"
    assert a.stop_hit.n_tokens == 2  # "Hello", " w" lie before the stop
    # nothing after the stop is released
    assert all("end" not in c for c in chunks)


def test_stop_string_inside_one_token_keeps_the_prefix_text():
    a, chunks = run([1, 3], stop=["rl"])
    assert a.text == "Helloo"
    assert a.stop_hit.n_tokens == 1
    assert "".join(chunks) == "Helloo"


def test_partial_stop_prefix_is_held_back_then_released():
    a, chunks = run([1, 8, 10], stop=["STOP"])
    # "STO" could start "STOP": held back until " end" shows it does not
    assert chunks[1] == ""
    assert "".join(chunks) == a.text == "HelloSTO end"
    assert a.stop_hit is None


def test_invalid_bytes_become_replacement_and_still_concatenate():
    a, chunks = run([1, 11, 2])
    assert "".join(chunks) == a.text
    assert "\ufffd" in a.text


def test_dangling_partial_character_flushed_at_finish():
    a, chunks = run([1, 6])
    assert "".join(chunks) == a.text == "Hello\ufffd"


def test_token_offsets_count_completed_characters():
    from localspec.text import token_offsets

    # "Hello" "é"(2 tokens) "😀"(2 tokens) " w": a token inside a character has its offset
    assert token_offsets(PIECES.__getitem__, [1, 4, 5, 6, 7, 2]) == [0, 5, 5, 6, 6, 7]
    assert token_offsets(PIECES.__getitem__, []) == []


def test_release_tracker_gives_items_out_with_their_text_and_drops_cut_ones():
    from localspec.text import ReleaseTracker

    toks = [1, 2, 8, 9, 10]  # "Hello w" then "STOP!": the stop string "STOP" cuts 8 and 9
    a = TextAssembler(PIECES.__getitem__, ["STOP"])
    tr = ReleaseTracker(PIECES.__getitem__)
    got = []
    for t in toks:
        text = a.push(t)
        tr.add(t, f"lp{t}")
        got.append(tr.release(text))
        if a.stop_hit:
            break
    assert got == [[("lp1", 0)], [("lp2", 5)], [], []]  # "STO" held back, then cut
    assert tr.flush(a.stop_hit.n_tokens) == [] and tr.n_out == 2
    tr = ReleaseTracker(PIECES.__getitem__)
    tr.add(4, "a")  # first byte of é: no text yet, but the token's text is all out
    assert tr.release("") == [("a", 0)]
    tr.add(5, "b")
    assert tr.release("") == [] and tr.release("é") == [("b", 0)]
