"""verl's side: the agent-loop manager and workers, the reward manager, the checks of verl's config."""
