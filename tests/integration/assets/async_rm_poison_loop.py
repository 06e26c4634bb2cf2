"""An agent loop whose response ends in ``</s>``: the NaN-RM of the tests (``rm_cases.save_nan_rm``, whose ``</s>``
embedding is NaN) scores it NaN, so its RM score fails (NonFiniteScoreError) while its group mates score normally."""

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class PoisonedAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params, **kwargs):
        output = await super().run(sampling_params, **kwargs)
        poison = self.tokenizer.convert_tokens_to_ids("</s>")
        if output.response_ids:
            output.response_ids = [*output.response_ids[:-1], poison]
        else:
            output.response_ids, output.response_mask = [poison], [1]
        return output
