"""On-policy RL with the trainer's logprobs equal to the engine's: a GRPO loop on SmolLM2 with
vLLM (bik's plugin, in this process) sampling and Hugging Face transformers (under
bik.enable()) training, the weights pushed into the running engine after every step.

:mod:`bik.rl.task` (the verifiable reward), :mod:`bik.rl.engine` (rollouts with processed
logprobs, the weight update), :mod:`bik.rl.trainer` (packed logprobs, GRPO loss, AdamW on fp32
masters), :mod:`bik.rl.loop` (the steps and their records); CLI: ``bik rl``. Needs the vLLM venv
(``make venv-vllm``).
"""

from bik.rl.loop import RLConfig, check_config, check_fingerprints, run

__all__ = ["RLConfig", "check_config", "check_fingerprints", "run"]
