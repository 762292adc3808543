"""A multi-turn verifiers environment on local data: guess a secret number in [1, 9]; the environment
answers 'higher' / 'lower' (env_response) until the guess is right or max_turns run out. Reward
1 - 0.25 x (turns - 1) when found, else 0 (found_fast), from the rubric."""

import re

import verifiers as vf
from datasets import Dataset


def _guess(text):
    found = re.findall(r"\d+", text or "")
    return int(found[-1]) if found else None


def _content(message):
    return message["content"] if isinstance(message, dict) else message.content


class HotCold(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess, secret = _guess(_content(messages[-1])), int(state["answer"])
        if guess == secret:
            state["found"] = True
            state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
            return state["final_env_response"]
        hint = "Please answer with a number." if guess is None else ("Higher." if secret > guess else "Lower.")
        return [{"role": "user", "content": hint}]

    @vf.stop
    async def found(self, state, **kwargs) -> bool:
        return bool(state.get("found"))


def found_fast(state, **kwargs) -> float:
    turns = len(state["trajectory"])
    last = _guess(_content(state["trajectory"][-1]["completion"][-1])) if turns else None
    return 1.0 - 0.25 * (turns - 1) if last == int(state["answer"]) else 0.0


def load_environment(max_turns: int = 4) -> vf.Environment:
    data = Dataset.from_list(
        [{"question": "I think of a number from 1 to 9. Guess it.", "answer": str(s)} for s in (3, 7, 5, 2)]
    )
    return HotCold(dataset=data, rubric=vf.Rubric(funcs=[found_fast]), max_turns=max_turns)
