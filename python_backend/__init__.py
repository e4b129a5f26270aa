"""The models Triton serves for fair_frontend, as plain Python the Triton stub imports.

``model_repository/<model>/1/model.py`` holds only Triton's ``TritonPythonModel`` contract;
everything else lives here so it can be imported and tested without Triton:

- ``nets``: the two PyTorch networks (encoder for ``embed``, causal decoder for ``generate``),
  built from fixed seeds; nothing is downloaded.
- ``rows``: how one Triton request becomes rows (ragged batches, per-row metadata), and how
  the rows of several requests are packed into one tensor and split back.
- ``embed``, ``generate``: the two served models on top of ``rows`` and ``nets``.
- ``metering``: per-tenant counters exported on Triton's metrics port.
- ``settings``: per-model ``parameters`` from ``config.pbtxt`` (``torch_threads``, ...).
- ``export_torchscript``: the ``embed`` network as a libtorch-backend model repository.

Ragged batches travel as padding plus per-row lengths in a request parameter. The frontend
sends ONE Triton request per batch: ``INPUT_IDS`` ``[B, Lmax]`` right-padded with 0, and
each row's real length in the ``fair_rows`` parameter (its ``length`` list, beside tenant,
priority, deadline and, on ``generate``, ``max_tokens``). A direct client sends
``INPUT_IDS`` alone; then every row's length is the full width. Both cases build the
attention mask from lengths (defaulting to the width), so a row takes the same code path
whether or not lengths were sent: bit-identical for a batch of one row, equal to float
rounding when padded next to longer rows.

Why padding plus lengths: the frontend, not Triton's batcher, decides which rows share a
batch, and it must hand Triton that batch as one rectangular tensor; the lengths make the
padding invisible to the model. Why a parameter, not an input: ``INPUT_IDS`` is the only
model input, so a load generator that fills every declared input with random data
(perf_analyzer does, optional inputs included) sends a valid request.
``allow_ragged_batch`` is also set on ``INPUT_IDS``: it only lets Triton's own dynamic
batcher give ``execute`` requests of different widths (from direct clients), which
``rows.pack`` pads together the same way.
"""
