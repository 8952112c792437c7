"""``splice_placeholders``: the placeholder expansion every multimodal input processor shares.

Random text ids, random replacement layouts (a start marker or none, a run of item tokens of
varying length, an end marker or none) and placeholders in several layouts, against a
reference that joins the text segments and the replacements and sums their lengths.
"""

from __future__ import annotations

import random

import pytest

from mrv2.contract.input_processor import splice_placeholders
from mrv2.contract.requests import MultiModalItem

PLACEHOLDER = 7
START, END, ITEM = 8, 9, 10


def _prompt(rng: random.Random, length: int, places: list[int]) -> list[int]:
    ids = [rng.randrange(100, 5000) for _ in range(length)]
    for place in places:
        ids[place] = PLACEHOLDER
    return ids


LAYOUTS: dict[str, tuple[int, list[int]]] = {  # name: (prompt length, placeholder positions)
    "none": (9, []),
    "first": (6, [0]),
    "last": (6, [5]),
    "first_and_last": (8, [0, 7]),
    "adjacent": (10, [3, 4, 5]),
    "only_placeholders": (3, [0, 1, 2]),
    "single_token_prompt": (1, [0]),
    "spread": (25, [2, 9, 10, 17, 24]),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_splice_matches_reference(layout: str, seed: int) -> None:
    rng = random.Random(f"{layout}-{seed}")
    length, places = LAYOUTS[layout]
    prompt = _prompt(rng, length, places)
    # per placeholder: a start marker or not, 1..9 item tokens, an end marker or not
    shapes = [(rng.random() < 0.5, rng.randint(1, 9), rng.random() < 0.5) for _ in places]
    calls: list[tuple[int, int]] = []

    def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
        calls.append((n, offset))
        start, count, end = shapes[n]
        tokens = [START] * start + [ITEM] * count + [END] * end
        return tokens, MultiModalItem("image", {"n": n}, f"image:{n}", offset + start, count)

    ids, items = splice_placeholders(prompt, places, expand)

    # reference: the text between placeholders and each replacement, joined in order
    bounds = [-1, *places, len(prompt)]
    segments = [prompt[a + 1:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    replacements = [[START] * s + [ITEM] * c + [END] * e for s, c, e in shapes]
    want: list[int] = list(segments[0])
    offsets: list[int] = []
    for n, replacement in enumerate(replacements):
        offsets.append(len(want))
        want += replacement + segments[n + 1]
    assert ids == want
    assert PLACEHOLDER not in ids
    assert calls == list(enumerate(offsets))
    assert [item.data["n"] for item in items] == list(range(len(places)))
    for item, (start, count, _), offset in zip(items, shapes, offsets, strict=True):
        assert (item.offset, item.length) == (offset + start, count)
        assert ids[item.offset:item.offset + item.length] == [ITEM] * count
    assert len(ids) == length - len(places) + sum(map(len, replacements))


def test_no_places_copies_the_prompt() -> None:
    prompt = _prompt(random.Random(3), 5, [])

    def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
        raise AssertionError("no placeholder to expand")

    ids, items = splice_placeholders(prompt, [], expand)
    assert ids == prompt and ids is not prompt and items == []


@pytest.mark.parametrize("places", [[3, 3], [4, 2], [6], [-1]])
def test_places_out_of_order_or_range_refused(places: list[int]) -> None:
    prompt = _prompt(random.Random(4), 6, [])

    def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
        return [ITEM], MultiModalItem("image", None, "image:x", offset, 1)

    with pytest.raises(ValueError, match="places must increase"):
        splice_placeholders(prompt, places, expand)


@pytest.mark.parametrize("shift, length", [(-1, 2), (1, 2), (0, 3)])
def test_item_outside_its_tokens_refused(shift: int, length: int) -> None:
    prompt = _prompt(random.Random(5), 6, [2])

    def expand(n: int, offset: int) -> tuple[list[int], MultiModalItem]:
        return [ITEM, ITEM], MultiModalItem("image", None, "image:x", offset + shift, length)

    with pytest.raises(ValueError, match="lies outside its 2 tokens at offset 2"):
        splice_placeholders(prompt, [2], expand)
