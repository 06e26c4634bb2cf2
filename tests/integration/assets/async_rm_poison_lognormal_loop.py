"""The demo's sampling agent loop whose response ends in ``</s>``: the NaN-RM of the tests (``rm_cases.save_nan_rm``,
whose ``</s>`` embedding is NaN) scores it NaN, so its RM score fails (NonFiniteScoreError). The loop it extends
samples ordinary tokens only, so on verl's real vLLM rollout no other trajectory can hold ``</s>``."""

from verl_async_rm.demo.agent_loop import LogNormalLengthAgentLoop


class PoisonedLogNormalAgentLoop(LogNormalLengthAgentLoop):
    async def run(self, sampling_params, **kwargs):
        output = await super().run(sampling_params, **kwargs)
        output.response_ids = [*output.response_ids[:-1], self.tokenizer.convert_tokens_to_ids("</s>")]
        return output
