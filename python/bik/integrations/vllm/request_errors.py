"""One request's bad logits end that request alone (issue 50). bik.sample gives a row with no
finite logit to draw from (a NaN, a +inf logit, every logit -inf: docs/design.md, "NaN and
inf") token -1; the plugin used to raise for the whole batch, which lost every other request's
output and left vLLM's engine wedged. Now the sampler notes the row (its token set to 0 so the
step's bookkeeping goes on), the model runner hands the failed requests' ids to the scheduler
on its output, and the scheduler drops their token and ends them through vLLM's own per-request
error path (``FinishReason.ERROR``, the one it uses for a request whose encoder cache or KV load
failed): the request's output says ``finish_reason="error"``, every other request keeps its
token, and the engine serves on. A single -inf bias is an ordinary ban, never an error.

The check reads the tokens on the host, so it runs on the CPU (on a GPU it would sync every
step; there a -1 row is still a row of its own, with the token it is given)."""

from __future__ import annotations

import functools

__all__ = ["FAILED", "fail", "install"]

FAILED = [0]  # requests ended by their own bad logits in this process


def fail(runner, req_ids) -> None:
    """Marks these requests of the current step as failed (the scheduler ends them)."""
    failed = getattr(runner, "_bik_failed_req_ids", None)
    if failed is None:
        failed = runner._bik_failed_req_ids = []
    failed.extend(r for r in req_ids if r not in failed)


def _attach(output, failed: list[str]):
    from vllm.v1.outputs import ModelRunnerOutput

    if isinstance(output, ModelRunnerOutput):
        output.bik_failed_req_ids = failed
    elif hasattr(output, "get_output"):  # async scheduling: the output is made later
        get_output = output.get_output

        def get_output_with_failures():
            out = get_output()
            out.bik_failed_req_ids = failed
            return out

        output.get_output = get_output_with_failures
    return output


def _sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        self._bik_failed_req_ids = []
        output = original(self, *args, **kwargs)
        failed, self._bik_failed_req_ids = self._bik_failed_req_ids, []
        return _attach(output, failed) if failed else output

    sample_tokens.bik_wrapped = True
    return sample_tokens


def _update_from_output(original):
    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, "bik_failed_req_ids", None)
        if failed:
            tokens = model_runner_output.sampled_token_ids
            for req_id in failed:
                index = model_runner_output.req_id_to_index.get(req_id)
                if index is not None and tokens:
                    tokens[index] = []  # no token from its step
            # vLLM's per-request error path: ended with FINISHED_ERROR after this step's
            # outputs, an output with finish_reason "error" sent to its client
            self.encoder_cache_mismatch_reqs.update(failed)
            FAILED[0] += len(failed)
        return original(self, scheduler_output, model_runner_output)

    update_from_output.bik_wrapped = True
    return update_from_output


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.sample_tokens, "bik_wrapped", False):
        GPUModelRunner.sample_tokens = _sample_tokens(GPUModelRunner.sample_tokens)
    if not getattr(Scheduler.update_from_output, "bik_wrapped", False):
        Scheduler.update_from_output = _update_from_output(Scheduler.update_from_output)
