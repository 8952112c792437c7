"""Structured outputs (``SamplingParams.structured_outputs``): every finished output matches its
constraint, greedy and sampled, ``n > 1``, with async scheduling and beside unconstrained
requests (which are unchanged by them); bad constraints are refused before any work, naming
the field, and the engine keeps serving.

The tiny model has random weights, so an unconstrained run would almost never produce any of
these outputs: a match is the mask at work. The JSON schema is bounded (a two-digit integer,
an enum, no whitespace) so every sample ends within ``max_tokens``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams, StructuredOutputsParams
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint, make_tiny_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"enum": ["x", "y"]}}}
PROMPTS = ["Hello world", "The capital of France", "Paris"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path)
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, async_scheduling=True)


def _matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"a", "b"} and isinstance(value["a"], int)
            and 0 <= value["a"] <= 99 and value["b"] in ("x", "y"))


CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _matches_schema),
    "json_text": (StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
                  _matches_schema),
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) is not None),
    "choice": (StructuredOutputsParams(choice=["Paris", "London", 'New "York"']),
               lambda t: t in ("Paris", "London", 'New "York"')),
    "grammar": (StructuredOutputsParams(grammar='start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]/'),
                lambda t: re.fullmatch(r"\([0-9](,[0-9])?\)", t) is not None),
    # vLLM's EBNF (llama.cpp's GBNF, xgrammar's grammar syntax, which vLLM's docs use)
    "ebnf": (StructuredOutputsParams(grammar='root ::= "(" num ("," num)? ")"\nnum ::= [0-9]'),
             lambda t: re.fullmatch(r"\([0-9](,[0-9])?\)", t) is not None),
    # (Lark's inlined start rule, whatever it holds, is still read as Lark)
    "lark_inlined": (StructuredOutputsParams(grammar='?start: "a ::= b" | "c"'),
                     lambda t: t in ("a ::= b", "c")),
}


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(CASES))
def test_every_output_matches(llm: LLM, kind: str, temperature: float) -> None:
    spec, ok = CASES[kind]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=40,
                            n=2 if temperature else 1,  # (greedy: n=1 only, as vLLM's)
                            structured_outputs=spec)
    before = dict(vars(params))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (kind, sample.text)
            assert ok(sample.text), (kind, sample.text)
    assert vars(params) == before  # the caller's params untouched


def test_json_object_opens_an_object(llm: LLM) -> None:
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    for out in llm.generate(PROMPTS, SamplingParams(temperature=0.9, seed=3, max_tokens=12,
                                                    structured_outputs=spec), use_tqdm=False):
        text = out.outputs[0].text
        assert text.startswith("{"), text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_constrained_and_free_requests_do_not_touch_each_other(llm: LLM) -> None:
    """In one batch: the free requests give what they give alone (the masks hit their own rows
    only), and a constrained request gives what it gives alone (its seed, its positions)."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    guided = SamplingParams(temperature=0.9, seed=11, max_tokens=30,
                            structured_outputs=CASES["regex"][0])
    alone_free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    alone_guided = llm.generate(PROMPTS[0], guided, use_tqdm=False)[0].outputs[0].text
    mixed = llm.generate(PROMPTS + [PROMPTS[0]], [free, free, free, guided], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone_free
    assert mixed[3].outputs[0].text == alone_guided
    assert CASES["regex"][1](alone_guided)


def test_properties_come_in_each_schemas_order(llm: LLM) -> None:
    """Two schemas that differ only in the order of their properties: each answer lists them
    in its own schema's order (the compiled grammars are cached apart)."""
    def params(keys: str) -> SamplingParams:
        schema = {"type": "object", "additionalProperties": False, "required": ["p", "q"],
                  "properties": {k: {"enum": [k.upper()]} for k in keys}}
        return SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=(
            StructuredOutputsParams(json=schema, disable_any_whitespace=True)))

    for keys in ("pq", "qp"):
        out = llm.generate("Hello", params(keys), use_tqdm=False)[0].outputs[0]
        assert list(json.loads(out.text)) == list(keys), out.text


def _run_steps(llm: LLM, params: list[SamplingParams], late: bool
               ) -> tuple[int, list[list[int]], list[str]]:
    """Every request of ``params`` (one per prompt) through the engine's own loop; returns the
    steps taken, each request's tokens and finish reason."""
    engine = llm.engine
    was, engine.scheduler.late_token_masks = engine.scheduler.late_token_masks, late
    try:
        assert engine.tokenizer is not None
        ids = [engine.add_request(engine.tokenizer.encode(p), sp)
               for p, sp in zip(PROMPTS, params, strict=False)]
        done, steps = {}, 0
        while engine.has_unfinished():
            steps += 1
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        engine.scheduler.late_token_masks = was
    outs = [done[i].outputs[0] for i in ids]
    return steps, [o.token_ids for o in outs], [o.finish_reason or "" for o in outs]


def test_with_async_scheduling_a_constrained_request_samples_every_step(llm: LLM) -> None:
    """Its mask is filled during the step's forward, once its token in flight has arrived: it
    samples every step, as a free request does, and gives the tokens it gives when it waits
    for each token before its next step (every other step: ``MRV2_LATE_TOKEN_MASKS=0``)."""
    assert llm.engine.scheduler.late_token_masks  # the default with a runner in this process
    spec = StructuredOutputsParams(regex=r"[a-z]{24}")
    params = [SamplingParams(temperature=t, seed=5, max_tokens=40, structured_outputs=spec)
              for t in (0.0, 0.9)]
    params.append(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    late_steps, late_tokens, late_reasons = _run_steps(llm, params, late=True)
    slow_steps, slow_tokens, _ = _run_steps(llm, params, late=False)
    assert late_tokens == slow_tokens
    assert late_reasons[:2] == ["stop", "stop"]
    longest = max(len(t) for t in late_tokens[:2])
    assert longest >= 6, late_tokens  # ("[a-z]{24}" takes several tokens of this vocabulary)
    assert late_steps <= longest + 3 < 2 * longest - 1 <= slow_steps


def test_a_constrained_request_that_ends_while_its_next_step_runs(llm: LLM) -> None:
    """A choice completes on a token the engine learns of while the request's next step is
    already launched: that step's row samples with every token allowed and its token is
    dropped; the other constrained request (still matching) keeps its own mask."""
    short = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=CASES["choice"][0])
    long = SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(regex=r"[0-9]{30}"))
    _, tokens, reasons = _run_steps(llm, [short, long], late=True)
    assert reasons == ["stop", "stop"]
    texts = [llm.engine.tokenizer.decode(t) for t in tokens]  # type: ignore[union-attr]
    assert texts[0] in ("Paris", "London", 'New "York"'), texts
    assert re.fullmatch(r"[0-9]{30}", texts[1]), texts


def test_constrained_steps_sample_in_the_graph_tail(tmp_path: Path) -> None:
    """Through the CUDA-graph decode path (emulated on the CPU): a step with constrained rows
    masks the forward graph's logits in place and samples in the sampling tail graph, every
    decode step, giving the eager path's tokens."""
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    params = [SamplingParams(temperature=0.9, seed=2, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{9}")),
              SamplingParams(temperature=0.0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{14}")),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]

    def run(graphs: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=4,
                  max_model_len=64, async_scheduling=True)
        if graphs:
            emulate_cuda_graphs(llm.engine.runner)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    eager, _ = run(False)
    got, llm = run(True)
    assert got == eager
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    forward = {key: g.replays for key, g in graphs.graphs.items()  # type: ignore[attr-defined]
               if key[0] == 1}
    tails = {(q, size): g.replays for (q, size, variant), g in graphs.tail_graphs.items()
             if variant == 0}  # type: ignore[attr-defined]
    assert sum(forward.values()) >= 8
    assert all(tails[key] == n for key, n in forward.items())


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputsParams(regex="[0-9"), "structured_outputs.regex is invalid: .*regex"),
    (StructuredOutputsParams(json={"type": "nonsense"}),
     "structured_outputs.json is invalid: .*nonsense"),
    (StructuredOutputsParams(grammar="start: undefined_rule"),
     "structured_outputs.grammar is invalid: .*undefined_rule"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"),
     "structured_outputs.grammar is invalid: .*undefined_rule"),
    (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {}}),
     "structured_outputs.structural_tag is invalid: the \"format\" form .* xgrammar's"),
    (StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>", "schema": {},
                                                             "end": "</a>"}],
                                             "triggers": ["<b"]}),
     "structured_outputs.structural_tag is invalid: no trigger begins the structure '<a>'"),
])
def test_a_bad_constraint_is_refused_before_work(llm: LLM, spec: StructuredOutputsParams,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing was added
    out = llm.generate("x", SamplingParams(max_tokens=20, structured_outputs=CASES["choice"][0]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("Paris", "London", 'New "York"')  # and it keeps serving
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of json, json_object, regex, choice, grammar, structural_tag "
         "\\(got none\\)"),
    ({"regex": "a", "choice": ["b"]}, "\\(got regex, choice\\)"),
    ({"choice": []}, "structured_outputs.choice=\\[\\] is invalid"),
    ({"json": "{not json"}, "structured_outputs.json is invalid: expected a JSON schema"),
    ({"json": 3}, "structured_outputs.json is invalid"),
    ({"json_object": "false"}, "structured_outputs.json_object='false' is invalid: expected "
                               "true or false"),
    ({"regex": "a", "disable_any_whitespace": "no"},
     "structured_outputs.disable_any_whitespace='no' is invalid"),
    ({"json": {}, "disable_additional_properties": 1},
     "structured_outputs.disable_additional_properties=1 is invalid"),
    ({"json": {}, "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern='' is"),
    ({"structural_tag": "[1]"}, "structured_outputs.structural_tag is invalid: expected a "
                                "structural tag"),
    ({"structural_tag": 3}, "structured_outputs.structural_tag is invalid"),
])
def test_the_params_name_what_is_wrong(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_outputs=.*StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_logprobs_are_those_of_the_masked_logits(llm: LLM, temperature: float) -> None:
    """As vLLM's (its runner masks the logits before its sampler reads the raw logprobs): a
    constrained request's logprobs put all the probability on the tokens its grammar allows
    (the finite ones of the top 20, more than a choice ever allows, sum to 1), and a greedy
    token is rank 1."""
    import math

    spec = StructuredOutputsParams(choice=["Paris", "London"])
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=10, logprobs=20,
                            structured_outputs=spec)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        sample = out.outputs[0]
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for token, position in zip(sample.token_ids, sample.logprobs, strict=True):
            finite = [lp.logprob for lp in position.values() if lp.logprob > -math.inf]
            assert len(finite) < 20 and sum(map(math.exp, finite)) == pytest.approx(1, abs=1e-4)
            if temperature == 0.0:
                assert position[token].rank == 1


PROBES = (",", "}", "{", " ", "\n", "a", "h", "<", '"')


def _allowed_after(llm: LLM, spec: StructuredOutputsParams, text: str,
                   probes: tuple[str, ...] = PROBES) -> set[str]:
    """Which of ``probes`` (one token each) a fresh matcher of ``spec`` allows after it
    consumed ``text``'s tokens."""
    import numpy as np

    from mrv2.engine.structured_outputs import fill_bitmasks

    so = llm.engine._structured_outputs()
    tokenizer = llm.get_tokenizer()
    guide = so.guide(SamplingParams(structured_outputs=spec), [])
    for token in tokenizer.encode(text, add_special_tokens=False):
        guide.advance(token)
        assert not guide.matcher.is_error(), (text, guide.matcher.get_error())
    row = np.empty((1, so.words), dtype=np.int32)
    fill_bitmasks([guide], row)
    allowed = set()
    for probe in probes:
        (token,) = tokenizer.encode(probe, add_special_tokens=False)
        if int(row[0].view(np.uint32)[token // 32]) >> (token % 32) & 1:
            allowed.add(probe)
    return allowed


def test_disable_additional_properties_closes_objects(llm: LLM) -> None:
    """vLLM's ``disable_additional_properties``: an object schema that lists its properties
    and says nothing of others takes no others (nested ones too); one that says keeps it."""
    inner = {"type": "object", "properties": {"b": {"enum": [1]}}, "required": ["b"]}
    schema = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    for closed, after in ((True, {"}"}), (False, {",", "}"})):
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                       disable_additional_properties=closed)
        assert _allowed_after(llm, spec, '{"a":{"b":1') == after
        assert _allowed_after(llm, spec, '{"a":{"b":1}') == after
    stated = {**schema, "additionalProperties": {"type": "integer"}}
    spec = StructuredOutputsParams(json=stated, disable_any_whitespace=True,
                                   disable_additional_properties=True)
    assert _allowed_after(llm, spec, '{"a":{"b":1}') == {",", "}"}
    # an allOf's parts stay open (each closed would refuse the other's property: nothing
    # could match, a 400); what lies inside them is closed
    parts = {"allOf": [schema, {"type": "object", "properties": {"c": {"enum": [2]}},
                                "required": ["c"]}]}
    spec = StructuredOutputsParams(json=parts, disable_any_whitespace=True,
                                   disable_additional_properties=True)
    assert _allowed_after(llm, spec, '{"a":{"b":1') == {"}"}
    assert "," in _allowed_after(llm, spec, '{"a":{"b":1}')


def test_whitespace_pattern_is_the_whitespace_json_may_hold(llm: LLM) -> None:
    """vLLM's ``whitespace_pattern``: the whitespace allowed between JSON tokens (by default
    any; ``disable_any_whitespace``: none)."""
    cases = ((None, False, {" ", "\n", '"', "}"}), ("[ ]?", False, {" ", '"', "}"}),
             (None, True, {'"', "}"}))
    for pattern, compact, after in cases:
        spec = StructuredOutputsParams(json_object=True, whitespace_pattern=pattern,
                                       disable_any_whitespace=compact)
        assert _allowed_after(llm, spec, "{") == after, (pattern, compact)


def test_a_structural_tag_holds_what_follows_each_trigger(llm: LLM) -> None:
    """vLLM's structural tag: free text, in which a trigger opens its structure's ``begin``,
    then JSON of its schema, then its ``end``; the text is free again after it."""
    tag = {"type": "structural_tag", "triggers": ["<f="], "structures": [{
        "begin": "<f=a>", "end": "</f>",
        "schema": {"type": "object", "properties": {"x": {"enum": [1]}}, "required": ["x"],
                   "additionalProperties": False}}]}
    for given in (tag, json.dumps(tag)):
        spec = StructuredOutputsParams(structural_tag=given, disable_any_whitespace=True)
        assert {"h", "a", "{", "<", "\n"} <= _allowed_after(llm, spec, "hi ")
        assert _allowed_after(llm, spec, "hi <f=") == {"a"}
        assert _allowed_after(llm, spec, "hi <f=a>") == {"{"}
        assert _allowed_after(llm, spec, 'hi <f=a>{"x":1') == {"}"}
        assert _allowed_after(llm, spec, 'hi <f=a>{"x":1}') == {"<"}
        assert {"h", "a", "{", "<"} <= _allowed_after(llm, spec, 'hi <f=a>{"x":1}</f> ')


def test_draft_masks_are_the_masks_after_each_draft(llm: LLM) -> None:
    """``Guide.draft_masks``: row ``j`` is the mask a matcher has after consuming the first
    ``j`` drafts (checked against fresh matchers that consume them for real); past a draft
    the grammar refuses every token is allowed; the guide is left as it was."""
    import numpy as np

    from mrv2.engine.structured_outputs import fill_bitmasks, fill_draft_bitmasks

    so = llm.engine._structured_outputs()
    tokenizer = llm.get_tokenizer()
    digits = [tokenizer.encode(d, add_special_tokens=False) for d in "0123x9"]
    assert all(len(d) == 1 for d in digits), digits  # one token a character
    zero, one, two, three, x, nine = (d[0] for d in digits)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(0123){2}9"))

    def fresh(consumed: list[int]) -> np.ndarray:
        guide = so.guide(params, [])
        for token in consumed:
            guide.advance(token)
        row = np.empty((1, so.words), dtype=np.int32)
        fill_bitmasks([guide], row)
        return row[0]

    guide = so.guide(params, [])
    guide.advance(zero)
    before = fresh([zero])
    for drafts, valid in (([one, two, three], 3), ([one, x, three], 1), ([x, one], 0),
                          ([one, two, three, zero, one, two, three], 7)):
        out = np.full((1 + len(drafts), so.words), 7, dtype=np.int32)
        guide.draft_masks(drafts, out)
        for j in range(valid + 1):
            assert (out[j] == fresh([zero, *drafts[:j]])).all(), (drafts, j)
        assert (out[valid + 1 :] == -1).all()
        row = np.empty((1, so.words), dtype=np.int32)
        fill_bitmasks([guide], row)
        assert (row[0] == before).all() and guide.consumed == 1  # rolled back
    # several guides at once (a level of drafts a pool call), one done, one without drafts
    cases = [([zero], [one, two, three]), ([zero], [one, x]), ([], []), ([zero, one], [x]),
             ([zero, one, two, three] * 2 + [so.tokenizer.eos_token], [one])]
    guides = []
    for consumed, _ in cases:
        g = so.guide(params, [])
        for token in consumed:
            g.advance(token)
        guides.append(g)
    assert guides[-1].done and guides[-1].done_at == 9
    outs = [np.full((1 + len(d), so.words), 7, dtype=np.int32) for _, d in cases]
    fill_draft_bitmasks(list(guides), [d for _, d in cases], outs)
    for (consumed, drafts), got, g in zip(cases[:-1], outs, guides, strict=False):
        want = np.full_like(got, -1)
        for j in range(len(drafts) + 1):
            want[j] = fresh(consumed + drafts[:j])
            if j < len(drafts) and not (int(want[j].view(np.uint32)[drafts[j] // 32])
                                        >> drafts[j] % 32) & 1:
                break
        assert (got == want).all(), (consumed, drafts)
        assert g.consumed == len(consumed)
    assert (outs[-1] == -1).all()  # a finished guide's rows allow every token
    # drafts that complete the match, then the end: the row after the last draft of the
    # match allows only the end; past the end every token; the guide rolls back exactly
    # (a stopped matcher does not count the end it is given, so the end is not consumed)
    eos = so.tokenizer.eos_token
    g = so.guide(params, [])
    for token in [zero, one, two, three, zero]:
        g.advance(token)
    out = np.full((6, so.words), 7, dtype=np.int32)
    g.draft_masks([one, two, three, nine, eos], out)
    assert (out[3] == fresh([zero, one, two, three, zero, one, two, three])).all()
    bits = np.unpackbits(out[4].view(np.uint8), bitorder="little")
    assert bits[eos] == 1 and bits.sum() == 1  # the end only
    assert (out[5] == -1).all() and g.consumed == 5 and g.done_at is None
    for token in [one, two, three, nine]:
        g.advance(token)
    assert g.done and g.done_at == 9 and not g.matcher.is_error()


def _spec_llm(path: Path, k: int, graphs: bool = False, method: str = "strict") -> LLM:
    kwargs: dict[str, object] = {}
    if k:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                        "rejection_sample_method": method}
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
              max_model_len=96, async_scheduling=True, **kwargs)
    if graphs:
        emulate_cuda_graphs(llm.engine.runner)
    return llm


@pytest.mark.parametrize(("graphs", "method"), [(False, "strict"), (True, "strict"),
                                               (False, "probabilistic")],
                         ids=["eager", "graphs", "probabilistic"])
def test_with_speculation_a_constrained_request_verifies_drafts(tmp_path: Path, graphs: bool,
                                                                method: str) -> None:
    """An n-gram speculator over prompts of repeated digits (one token each): a constrained
    request verifies drafts, its masks covering every draft position, so the drafts its
    grammar forces are kept (fewer steps) and one the grammar refuses is rejected where it
    diverges; every request's tokens, constrained or free, greedy or seeded, are those of a
    run without speculation (strict verification), through the graph path too; verified
    probabilistically, every answer still matches its constraint."""
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    prompt = "0123012301230123"
    params = [
        SamplingParams(temperature=0.0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex="(0123){5}")),
        SamplingParams(temperature=0.0, max_tokens=30,  # the drafts say 0, the grammar 9
                       structured_outputs=StructuredOutputsParams(regex="0123012399")),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30,
                       structured_outputs=CASES["json"][0]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    ]
    prompts = [prompt, prompt, "Hello world", prompt]
    want = [o.outputs[0].token_ids
            for o in _spec_llm(path, 0).generate(prompts, params, use_tqdm=False)]
    llm = _spec_llm(path, 3, graphs, method)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if method == "strict":
        assert [o.outputs[0].token_ids for o in outs] == want
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] == "0123" * 5 and texts[1] == "0123012399"
    assert CASES["json"][1](texts[2])
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] >= 10, stats  # the forced digits, kept as drafts


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, int, int]:
    """A tiny model whose tokenizer has ``<think>`` / ``</think>`` tokens, and their ids."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("think"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, async_scheduling=True)
    tokenizer = llm.get_tokenizer()
    start, end = (tokenizer.encode(t, add_special_tokens=False)[0]
                  for t in ("<think>", "</think>"))
    return llm, start, end


CHOICES = ["Paris", "London"]


def _think(llm: LLM, prompt: list[int], reasoning: str | None, bias: dict[int, float],
           seed: int = 0) -> tuple[str, list[int]]:
    params = SamplingParams(temperature=0.9, seed=seed, max_tokens=30, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning=reasoning)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    return out.text, out.token_ids


def test_with_a_reasoning_parser_the_grammar_holds_after_the_thinking_block(
        thinker: tuple[LLM, int, int]) -> None:
    """vLLM's reasoning-aware structured outputs. A prompt that opened the block (DeepSeek-R1's
    template): free until ``</think>`` (a bias makes the model close it at once), then held.
    One that closed it (Qwen3, ``enable_thinking: false``), or no reasoning parser: held from
    the first token, so the biased ``</think>`` never comes."""
    llm, start, end = thinker
    prompt = [5, 6, 7]
    text, ids = _think(llm, prompt + [start], "deepseek_r1", {end: 100.0})
    assert ids[0] == end and text in CHOICES
    for prompt_, reasoning in ((prompt + [start, end], "qwen3"), (prompt, None),
                               (prompt + [start], None)):
        text, ids = _think(llm, prompt_, reasoning, {end: 100.0})
        assert end not in ids and start not in ids and text in CHOICES, (prompt_, reasoning)


@pytest.mark.parametrize("seed", range(3))
def test_qwen3s_first_token_may_open_the_block(thinker: tuple[LLM, int, int],
                                               seed: int) -> None:
    """``qwen3`` with a prompt that leaves the block to the model: the first token may be the
    grammar's or ``<think>``, which frees the tokens until ``</think>``. Biased (``<think>``
    +60, ``</think>`` +100): ``<think>`` first (``</think>`` is not allowed there), then
    ``</think>``, then a choice; without the parser neither tag is ever allowed."""
    llm, start, end = thinker
    bias = {start: 60.0, end: 100.0}
    text, ids = _think(llm, [5, 6, 7], "qwen3", bias, seed)
    assert ids[:2] == [start, end] and text in CHOICES
    text, ids = _think(llm, [5, 6, 7], None, bias, seed)
    assert start not in ids and end not in ids and text in CHOICES


def test_gpt_oss_grammar_holds_after_its_final_header(tmp_path: Path) -> None:
    """``openai_gptoss`` (harmony): every token is free (the analysis, a tool call) until the
    model writes ``<|channel|>final<|message|>``, then the grammar holds; a draft that
    carries the header gets grammar masks past it and the guide is rolled back after; a
    tokenizer without the markers holds from the first token."""
    import numpy as np

    from mrv2.engine.structured_outputs import HARMONY_HEADER_GAP, fill_bitmasks

    path = make_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<|start|>", "<|channel|>", "<|message|>",
                                              "<|end|>"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    so = llm.engine._structured_outputs()
    tok = llm.get_tokenizer()
    header = tok.encode("<|channel|>final<|message|>", add_special_tokens=False)
    analysis = tok.encode("<|channel|>analysis<|message|>Hello<|end|><|start|>assistant",
                          add_special_tokens=False)
    assert len(header) >= 3
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning="openai_gptoss")
    paris = tok.encode("Paris", add_special_tokens=False)

    def mask(guide: object) -> np.ndarray:
        row = np.empty((1, so.words), dtype=np.int32)
        fill_bitmasks([guide], row)  # type: ignore[list-item]
        return row[0]

    def allows(row: np.ndarray, token: int) -> bool:
        return bool((int(row.view(np.uint32)[token // 32]) >> (token % 32)) & 1)

    guide = so.guide(params, [5, 6, 7])
    for token in analysis + header[:-1]:  # free: every token allowed
        assert (mask(guide) == -1).all()
        assert not guide.advance(token)
    drafts = [header[-1], paris[0]]
    out = np.full((1 + len(drafts), so.words), 7, dtype=np.int32)
    guide.draft_masks(drafts, out)
    assert (out[0] == -1).all() and not (out[1] == -1).all()  # held after the header
    assert allows(out[1], paris[0]) and not allows(out[1], header[0])
    assert guide.phase == "reasoning"  # rolled back: the header's last token not taken
    assert guide.tail == tuple((analysis + header[:-1])[-len(header) - HARMONY_HEADER_GAP:])
    assert not guide.advance(header[-1]) and guide.phase == "grammar"
    assert allows(mask(guide), paris[0]) and not allows(mask(guide), header[0])
    plain = so.guide(SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=CHOICES)), [5, 6, 7])  # no parser: held from the first token
    assert not allows(mask(plain), header[0])


def test_gpt_oss_grammar_holds_after_a_final_header_with_a_content_type(
        tmp_path: Path) -> None:
    """gpt-oss may write a content type in its final header (``<|channel|>final
    <|constrain|>json<|message|>``): the grammar still holds what follows (vLLM's rule), and
    a ``final`` that another header follows before ``<|message|>`` does not end the thinking."""
    from transformers import AutoTokenizer

    from mrv2.engine.structured_outputs import StructuredOutputs

    path = make_tiny_tokenizer(tmp_path, special_tokens=[
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"])
    tok = AutoTokenizer.from_pretrained(str(path))
    so = StructuredOutputs(tok, len(tok), [tok.eos_token_id])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning="openai_gptoss")
    for text, held in (
            ("<|channel|>final <|constrain|>json<|message|>", True),
            ("<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>final"
             "<|constrain|>json<|message|>", True),
            ("<|channel|>final<|end|><|start|>assistant<|channel|>analysis<|message|>", False)):
        guide = so.guide(params, [5, 6, 7])
        for token in tok.encode(text, add_special_tokens=False):
            guide.advance(token)
        assert (guide.phase == "grammar") == held, text
