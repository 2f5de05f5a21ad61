"""rlcore's backend conformance kit, run against the installed ``dtensor`` backend (dp=2).

The kit's tiny Llama has a single KV head, so it cannot be split over tp;
tensor parallel is covered against the same oracle by ``test_dtensor_parity``.
"""

from rlcore.testing.conformance import TrainingBackendConformance


class TestDTensorBackend(TrainingBackendConformance):
    backend_name = "dtensor"
