"""The per-request state contract's helpers: the rows each request owns (speculative decoding's
``1 + k``), and the allocation's refusals, raised before anything is allocated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrv2.contract import request_state
from mrv2.contract.request_state import (
    RequestStateLayer,
    StateShapes,
    allocate_request_states,
    state_row_slots,
)


class _Layer(RequestStateLayer):
    def __init__(self, shapes: StateShapes) -> None:
        super().__init__()
        self.shapes = shapes

    def request_state_shapes(self) -> StateShapes:
        return self.shapes


def test_rows_per_request() -> None:
    def config(method: str | None, k: int) -> SimpleNamespace:
        return SimpleNamespace(speculative=SimpleNamespace(method=method,
                                                           num_speculative_tokens=k))

    assert state_row_slots(config(None, 0)) == 1
    assert state_row_slots(config("ngram", 3)) == 4
    assert state_row_slots(config("mtp", 1)) == 2


def test_allocation_sizes_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _Layer({"conv": ((3, 5), None), "ssm": ((2, 4, 6), torch.float32)})
    nbytes = allocate_request_states([layer], 7, torch.bfloat16, torch.device("cpu"))
    assert nbytes == 7 * (3 * 5 * 2 + 2 * 4 * 6 * 4)
    assert layer.request_states["conv"].shape == (7, 3, 5)
    assert layer.request_states["conv"].dtype == torch.bfloat16
    assert layer.request_states["ssm"].dtype == torch.float32

    # too big for the GPU's free memory: refused before any tensor is made
    monkeypatch.setattr(request_state.torch.cuda, "mem_get_info",
                        lambda device=None: (nbytes, 10 * nbytes))
    fresh = _Layer(layer.shapes)
    with pytest.raises(ValueError, match=r"needs .* GiB \(7 rows: max_num_seqs 1 x 4 .*\) and "
                                         r".* free: lower scheduler.max_num_seqs, "
                                         r"speculative.num_speculative_tokens"):
        allocate_request_states([fresh], 7, torch.bfloat16, torch.device("cuda"),
                                "max_num_seqs 1 x 4 (1 + speculative tokens) + 3 slots")
    assert not hasattr(fresh, "request_states")

    with pytest.raises(ValueError, match=r"_Layer.request_state_shapes\(\): 'bad' has shape "
                                         r"\(0, 2\); every dimension must be >= 1"):
        allocate_request_states([_Layer({"bad": ((0, 2), None)})], 2, torch.float32,
                                torch.device("cpu"))


def test_step_states_read_the_forward_context() -> None:
    """A layer's :meth:`~RequestStateLayer.step_states`: the step's ``n`` requests' rows of the
    metadata and the context's state arguments as they are; outside a forward with state rows,
    a RuntimeError naming the layer."""
    from mrv2.contract.attention import AttentionMetadata
    from mrv2.contract.forward_context import ForwardContext, set_forward_context

    layer = _Layer({"conv": ((3, 5), None)})
    md = AttentionMetadata(
        num_reqs=2, num_tokens=6, max_query_len=4, max_seq_len=9,
        query_start_loc=torch.tensor([0, 4, 5, 5], dtype=torch.int32),
        seq_lens=torch.tensor([9, 3, 0], dtype=torch.int32),
        block_table=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(6, dtype=torch.int64), block_size=4)
    table = torch.zeros(4, 6, dtype=torch.int32)
    rows = torch.tensor([3, 1, 0], dtype=torch.int32)
    with set_forward_context(ForwardContext(md, [], [], state_rows=rows, state_table=table,
                                            state_row_slots=2)):
        st = layer.step_states()
    assert st.query_start_loc.tolist() == [0, 4, 5] and st.seq_lens.tolist() == [9, 3]
    assert st.rows.tolist() == [3, 1] and st.state_table is table
    assert (st.row_slots, st.max_query_len) == (2, 4)
    with set_forward_context(ForwardContext(md, [], [])), \
            pytest.raises(RuntimeError, match="_Layer needs the forward context's state_rows"):
        layer.step_states()
