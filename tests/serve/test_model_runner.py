"""The model runner's row selection: a view for one ascending run of rows, a copy in the
given order otherwise, the same values as indexing with the list either way."""

from __future__ import annotations

import torch

from lathe.serve.model_runner import select_rows


def test_select_rows_is_a_view_for_a_run_and_a_copy_otherwise():
    tensor = torch.arange(24.0).view(6, 4)
    for rows, view in [([0, 1, 2, 3, 4, 5], True), ([2, 3], True), ([4], True),
                       ([3, 1], False), ([0, 2, 3], False), ([1, 1], False), ([], False)]:
        picked = select_rows(tensor, rows)
        assert torch.equal(picked, tensor[rows]), rows
        assert (picked.data_ptr() == tensor[rows[0]].data_ptr() if view
                else picked.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr())
