"""torch.compile integration: parameters updated inside a backward that compiled autograd
traces.

Compiled autograd (``torch._dynamo.compiled_autograd``) traces the whole backward, hooks
included, into one graph in the order eager autograd runs the nodes, then
``reorder_accumulate_grad_nodes`` moves every AccumulateGrad, and the post-accumulate-grad
hooks after it, to right after the op that produces the gradient. That is earlier than eager
autograd, which runs them only once the producing node has finished. When the forward was
compiled the whole backward is one node (the AOT backward graph, pasted into the traced
graph), and it still reads a weight after producing that weight's gradient: ``mm(dy, W)``
for the input gradient comes after ``mm(dy.T, x)``. A hook that updates ``W`` in place
there feeds the updated ``W`` into the input gradients of every layer below: each update
is off by 1-40% after one step, with no error (eager autograd would have raised, as a saved
tensor was modified in place).

`install` wraps four of compiled autograd's capture steps, before the first backward of ours
that compiled autograd runs (`check_supported` calls it). Each acts only on a backward whose
inputs include a parameter that one of this package's optimizers updates in its hooks
("ours", by their record `core/ownership.py`); any other backward, and any other hook in
ours, gets torch's own code unchanged:
- `begin_capture` notes which graph inputs are ours and which share storage (a weight and
  its saved copy);
- `reorder_accumulate_grad_nodes` leaves the AccumulateGrad nodes that carry
  post-accumulate-grad hooks where eager autograd runs them (after the producing node);
- after `reorder_post_acc_grad_hook_nodes`, each such node and its hooks move up to just
  after the last read of the weight or of anything that may alias it (inputs on the same
  storage, the AOT backward's saved copy, views; an unknown callable's result counts as an
  alias), so the gradient is freed as early as eager LOMO frees it. When an input's storage
  cannot be read (tensor subclasses) the eager position stays. A bf16/fp16 embedding's
  gradient is computed by ATen's embedding backward there, not by the fp32 decomposition
  a compiled forward leaves (`use_eager_embedding_backward`);
- `end_capture`: the graph's Inductor compile runs without `reorder_for_locality`, with
  `delay_updates_past_reads`, and with `realizing_reads_before_writes`, so that each
  update stays after every read of its weight in the code Inductor emits. Otherwise
  Inductor clones the weights it updates and copies them back at the end of the graph
  (seen: every weight, the model held twice) and, once the clones are gone, fuses an
  elementwise read of a weight (RMSNorm's ``dy * weight``) into a kernel it runs after the
  update (seen: every gradient below the final norm off by about 1e-3 of the update).
These only decide what Inductor schedules where; the order compiled autograd traced, which
decides what is computed, is the one set above. `check_supported` and the refusal of an
eager forward stop the set-ups that cannot be made correct, before any parameter is written.

Modules, one job each:

    scope.py               `install`: the four capture steps above, acting only on backwards
                           holding our hooks
    ordering.py            where each update runs in the captured graph (after the last read
                           of its weight and its aliases)
    embedding_backward.py  a hooked bf16/fp16 embedding's gradient from ATen's backward
    aot_cache.py           loading a cached AOT backward graph from a copy of its state
    inductor_pass.py       Inductor post-grad pass: updates after every read of their input
    realize_reads.py       Inductor lowering: pending reads realized before an update
    version_gate.py        the tested torch versions; the refusal on others
    eager_forward.py       the refusal of an eager forward under compiled autograd

The embedding op itself is `lomo_kernels.ops.embedding`.
"""

from .eager_forward import EAGER_FORWARD_MESSAGE, is_aliased_input_failure
from .scope import install
from .version_gate import (
    TESTED_TORCH_VERSIONS,
    check_supported,
    compiled_autograd_active,
    torch_version_tested,
)

__all__ = [
    "EAGER_FORWARD_MESSAGE",
    "TESTED_TORCH_VERSIONS",
    "check_supported",
    "compiled_autograd_active",
    "install",
    "is_aliased_input_failure",
    "torch_version_tested",
]
