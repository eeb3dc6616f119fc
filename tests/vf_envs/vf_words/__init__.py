"""A single-turn verifiers Taskset: repeat a word. Two weighted rewards: the reply has an
even length (the tiny random model earns it about half the time, so groups vary) and the
reply says the word (weight 0.5); a metric that is recorded, never summed."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle"]


class WordsData(vf.TaskData):
    answer: str


class WordsTask(vf.Task[WordsData]):
    @vf.reward(weight=1.0)
    async def even_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) % 2 == 0)

    @vf.reward(weight=0.5)
    async def says_word(self, task: WordsData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply.lower())

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class WordsConfig(vf.TasksetConfig):
    count: int = 8
    split: str = "train"


class WordsTaskset(vf.Taskset[WordsTask, WordsConfig]):
    def load(self):  # type: ignore[no-untyped-def]
        offset = 0 if self.config.split == "train" else 3
        for i in range(self.config.count):
            word = WORDS[(i + offset) % len(WORDS)]
            data = WordsData(
                id=f"{self.config.split}-{i}",
                prompt=f"Repeat the word {word}.",
                system_prompt="Answer with one word.",
                answer=word,
            )
            yield WordsTask(data, self.config.task)


__all__ = ["WordsTaskset"]
