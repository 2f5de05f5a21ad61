"""LoRA under tensor parallel: tp=2 with sequence parallel against PEFT in one process.

The adapters are split like their base layers (column-wise: ``lora_B`` by
output features, and the LM head's ``lora_A`` over sequence shards; row-wise:
``lora_A`` by input features, ``lora_B`` over sequence shards); one SGD step
must give PEFT's adapters and logprobs, and the frozen base weights must stay frozen through the parallel styles (which
replace parameters). The dp layout is covered by the conformance kit's LoRA
section.
"""

from __future__ import annotations

from dtensor_testlib import batch as make_data
from dtensor_testlib import call_all, hf_logprobs, model_dir, policy_config, valid_diff

from rlcore.algorithms.loss_functions import NLLLoss
from rlcore.testing.conformance.lora import peft_adapters, peft_model, peft_sgd_step
from rlcore.testing.oracle import weight_problems

TOL = 1e-5
LR = 0.5
LORA = {
    "enabled": True,
    "dim": 4,
    "alpha": 8,
    "match_all_linear": True,
    "target_modules": ["lm_head"],
    "lora_A_init": "uniform",
}


def test_lora_step_under_tensor_parallel_matches_peft(ray_session, tiny_tokenizer, tmp_path):
    from rlcore.distributed import RayVirtualCluster
    from rlcore.policy import Policy

    llama, data = model_dir("llama"), make_data(tiny_tokenizer)
    cluster = RayVirtualCluster([2])
    policy = Policy(cluster, policy_config(llama, tp=2, sp=True, lora=LORA), tiny_tokenizer, name_prefix="dt-lora")
    try:
        dims = call_all(policy, "is_dtensor_model")[0]
        assert dims["model.layers.0.self_attn.q_proj.lora_B.weight"] == 2, "lora_B of a column-wise layer is tp-split"
        assert dims["model.layers.0.self_attn.o_proj.lora_A.weight"] == 2, "lora_A of a row-wise layer is tp-split"
        assert dims["lm_head.lora_B.weight"] == 2, "the LM head's lora_B is split by vocabulary"
        policy.save_checkpoint(str(tmp_path / "initial"))
        expected = peft_sgd_step(llama, tmp_path / "initial", data, NLLLoss(), LR)
        loss = float(policy.train(data, NLLLoss())["loss"][0])
        assert abs(loss - expected.loss) <= TOL * max(1.0, abs(expected.loss))
        policy.save_checkpoint(str(tmp_path / "step1"))
        problems = weight_problems(
            peft_adapters(peft_model(llama, tmp_path / "step1")),
            expected.adapters,
            expected.initial_adapters,
            TOL,
            what="tp=2 adapters vs PEFT",
        )
        assert not problems, "\n".join(problems)
        lengths = data["input_lengths"]
        assert valid_diff(policy.get_logprobs(data)["logprobs"], expected.logprobs, lengths) <= TOL
        reference = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
        assert valid_diff(reference, hf_logprobs(llama, data), lengths) <= TOL, "the frozen base weights moved"
    finally:
        policy.shutdown()
        cluster.shutdown()
