"""Reward models defined by their own code, in the shape of two public ones, for tests (``trust_remote_code``).

This file is copied into the tiny model directories that :mod:`verl_async_rm.testing.families` builds and named by
their ``config.json``'s ``auto_map``, so transformers loads it as a checkpoint's own code (it imports nothing from
this package):

- :class:`TinyInternLM2ForRewardModel` (``AutoModel``), like internlm2-*-reward: a decoder, a ``v_head``, the score at
  the last token of the attention mask, and ``get_score`` as on the model card (the reward token appended);
- :class:`TinyArmoRMForRewardModelWithGating` (``AutoModelForSequenceClassification``), like ArmoRM-Llama3-8B:
  per-objective rewards and a gating network, a custom output whose ``score`` is the gated preference score, the
  last token found by ``pad_token_id``, and no module named ``score``, ``v_head`` or ``classifier``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.utils import ModelOutput


class TinyInternLM2Config(LlamaConfig):
    model_type = "tiny_internlm2_reward"

    def __init__(self, reward_token_id: int = 0, **kwargs):
        self.reward_token_id = reward_token_id
        super().__init__(**kwargs)


class TinyInternLM2ForRewardModel(LlamaPreTrainedModel):
    config_class = TinyInternLM2Config

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.v_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.reward_token_id = config.reward_token_id
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden_states = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        hidden_states = self.v_head(hidden_states)
        # get end reward token's score (as InternLM2ForRewardModel.forward)
        ends = attention_mask.cumsum(dim=1).argmax(dim=1).view(-1, 1)
        reward_scores = torch.gather(hidden_states.squeeze(-1), 1, ends)
        return SequenceClassifierOutputWithPast(logits=reward_scores)

    @torch.no_grad()
    def get_score(self, tokenizer, conversation, **kwargs) -> float:
        conversation_str = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
        input_ids = tokenizer.encode(conversation_str, return_tensors="pt", add_special_tokens=False)
        # add reward score token at the end of the input_ids
        input_ids = torch.cat([input_ids, torch.tensor([[self.reward_token_id]], dtype=torch.long)], dim=1)
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        outputs = self.forward(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device))
        return outputs[0].cpu().item()


class TinyArmoRMConfig(LlamaConfig):
    model_type = "tiny_armorm"

    def __init__(self, num_objectives: int = 5, gating_hidden_dim: int = 16, **kwargs):
        self.num_objectives = num_objectives
        self.gating_hidden_dim = gating_hidden_dim
        super().__init__(**kwargs)


@dataclass
class ArmoRMOutput(ModelOutput):
    rewards: Optional[torch.FloatTensor] = None
    hidden_state: Optional[torch.FloatTensor] = None
    gating_output: Optional[torch.FloatTensor] = None
    score: Optional[torch.FloatTensor] = None


class TinyArmoRMForRewardModelWithGating(LlamaPreTrainedModel):
    config_class = TinyArmoRMConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.regression_layer = nn.Linear(config.hidden_size, config.num_objectives, bias=False)
        self.gating = nn.Sequential(
            nn.Linear(config.hidden_size, config.gating_hidden_dim),
            nn.ReLU(),
            nn.Linear(config.gating_hidden_dim, config.num_objectives),
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        hidden_states = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        # the last token: the one before the first pad (as ArmoRM), or the last one when there is no pad
        sequence_lengths = torch.eq(input_ids, self.config.pad_token_id).int().argmax(-1) - 1
        sequence_lengths = sequence_lengths % input_ids.shape[-1]
        rows = torch.arange(input_ids.shape[0], device=hidden_states.device)
        last = hidden_states[rows, sequence_lengths.to(hidden_states.device)]
        rewards = self.regression_layer(last)
        gating_output = torch.softmax(self.gating(last), dim=-1)
        score = (rewards * gating_output).sum(dim=-1)
        return ArmoRMOutput(rewards=rewards, hidden_state=last, gating_output=gating_output, score=score)
