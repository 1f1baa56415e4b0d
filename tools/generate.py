"""stub"""
TASK_FLAGS = "prompts tokens T p_cue"
DATA_FLAGS = "question answer grade chat think samples max_new_tokens out top_k top_p device dtype"
