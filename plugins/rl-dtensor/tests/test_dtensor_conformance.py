"""rlcore's backend conformance kit, run against the installed ``dtensor`` backend (dp=2).

The kit's tiny Llama has a single KV head, so it cannot be split over tp;
tensor parallel is covered against the same oracle by ``test_dtensor_parity`` (value models:
``test_dtensor_value``). The value-model checks (``-k value``) share the class.
"""

from rlcore.testing.conformance import TrainingBackendConformance, ValueModelConformance


class TestDTensorBackend(TrainingBackendConformance, ValueModelConformance):
    backend_name = "dtensor"
