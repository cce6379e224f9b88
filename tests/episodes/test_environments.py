"""TRL's environment_factory: the documented environments run unchanged."""

import asyncio
import copy
import random

import pytest

from jaxrl_llm.episodes.environments import Environments, append_observation
from jaxrl_llm.episodes.parsing import ToolCall, parse_turn
from jaxrl_llm.episodes.tools import ToolResult, call_tools
from jaxrl_llm.rewards import compute_rewards
from tests.episodes.test_tools import multiply  # TRL's documented tool

# The environments of TRL's GRPO documentation ("Agent Training" / "Environments"), as written there.


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return f"ran {len(code)} characters"


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        self.moves = getattr(self, "moves", 0) + 1
        return f"moved {action}"


def names_of(tools):
    return [tool.__name__ for tool in tools]


def test_increment_env_episode():
    """TRL's IncrementEnv, unchanged, through an episode: reset, a parsed call, the reward."""
    environments = Environments(IncrementEnv)
    assert not environments.multi and names_of(environments.tools_for(None)) == ["increment"]
    (env,) = environments.acquire(environments.names({"prompt": [[]]}, 1))
    (observation,) = environments.reset([env], [{"prompt": []}])
    assert observation == f"Increment the counter by {env.target}."
    text = f'<tool_call>\n{{"name": "increment", "arguments": {{"step": {env.target}}}}}\n</tool_call>'
    turn = parse_turn(text, call_format="hermes")
    assert call_tools([(environments.toolbox(env), call) for call in turn.calls], timeout=5) == [
        ToolResult("increment", str(env.target), False, False)
    ]
    (reward,) = environments.reward_functions()
    assert reward.__name__ == "IncrementEnv"
    assert reward(prompts=["p"], completions=["c"], environments=[env]) == [1.0]


def test_dataset_columns_reach_reset():
    class TargetEnv:  # TRL's "external dataset" variant
        def reset(self, target, **kwargs) -> None:
            self.counter = 0
            self.target = target

        def get_reward(self) -> float:
            return float(self.counter == self.target)

    environments = Environments(TargetEnv)
    envs = environments.acquire([None, None])
    examples = [{"prompt": [{"role": "user", "content": "to 3"}], "target": 3}, {"target": 5}]
    assert environments.reset(envs, examples) == [None, None]
    assert [env.target for env in envs] == [3, 5]


def test_tools_beside_environment_methods():
    environments = Environments(IncrementEnv, tools=[multiply])
    assert names_of(environments.tools_for(None)) == ["multiply", "increment"]
    (env,) = environments.acquire([None])
    environments.reset([env], [{}])
    toolbox = environments.toolbox(env)
    assert toolbox == {"multiply": multiply, "increment": env.increment}
    results = call_tools(
        [(toolbox, ToolCall("multiply", {"a": 2, "b": 3})), (toolbox, ToolCall("increment", {"step": 2}))], timeout=5
    )
    assert [r.content for r in results] == ["6", "2"] and env.counter == 2


class TestMultipleEnvironments:
    def test_environment_column_selects(self):
        environments = Environments({"coding": CodingEnv, "game": GameEnv})
        assert environments.multi
        assert names_of(environments.tools_for("coding")) == ["run_code"]
        assert names_of(environments.tools_for("game")) == ["move"]
        columns = {"environment": ["coding", "game", "game"]}
        names = environments.names(columns, 3)
        assert names == ["coding", "game", "game"]
        coding, game_1, game_2 = environments.acquire(names)
        assert type(coding) is CodingEnv and type(game_1) is GameEnv and game_1 is not game_2
        assert set(environments.toolbox(coding)) == {"run_code"} and set(environments.toolbox(game_1)) == {"move"}

    def test_environment_not_passed_to_reset(self):
        seen = []

        class Recorder:
            def reset(self, **kwargs) -> None:
                seen.append(kwargs)

        environments = Environments({"r": Recorder})
        environments.reset(environments.acquire(["r"]), [{"environment": "r", "seed": 1}])
        single = Environments(Recorder)
        single.reset(single.acquire([None]), [{"environment": "r", "seed": 1}])
        assert seen == [{"seed": 1}, {"environment": "r", "seed": 1}]

    def test_unknown_name(self):
        environments = Environments({"coding": CodingEnv, "game": GameEnv})
        with pytest.raises(ValueError, match=r"Unknown environment 'chess'.*\['coding', 'game'\]"):
            environments.names({"environment": ["game", "chess"]}, 2)
        with pytest.raises(ValueError, match="Unknown environment 'chess'"):
            environments.acquire(["chess"])

    def test_missing_column(self):
        environments = Environments({"coding": CodingEnv, "game": GameEnv})
        with pytest.raises(ValueError, match=r"needs an `environment` column.*\['prompt'\]"):
            environments.names({"prompt": [[]]}, 1)
        with pytest.raises(ValueError, match="2 values for 3 examples"):
            environments.names({"environment": ["game", "game"]}, 3)

    def test_bad_dict(self):
        with pytest.raises(ValueError, match="map environment names"):
            Environments({})
        with pytest.raises(TypeError, match=r"environment_factory\['game'\] must be a callable"):
            Environments({"game": GameEnv()})


class TestChecks:
    def test_missing_reset(self):
        class NoReset:
            def move(self, action: str) -> str:
                """Moves.

                Args:
                    action: Where to.
                """
                return action

        with pytest.raises(
            ValueError, match=r"environment_factory\['x'\] returned a NoReset, which has no callable `reset`"
        ):
            Environments({"x": NoReset})
        with pytest.raises(ValueError, match="^environment_factory returned a NoReset"):
            Environments(NoReset)

    def test_method_without_schema(self):
        class Sloppy:
            def reset(self, **kwargs):
                pass

            def move(self, action):
                return action

        with pytest.raises(ValueError, match="environment 'x': tool 'move' .*type hint"):
            Environments({"x": Sloppy})

    def test_method_clashing_with_a_tool(self):
        class Clash(GameEnv):
            def multiply(self, a: int, b: int) -> int:
                """Multiplies.

                Args:
                    a: One.
                    b: Two.
                """
                return a * b

        with pytest.raises(ValueError, match="two tools are named 'multiply'"):
            Environments(Clash, tools=[multiply])

    def test_private_and_reserved_methods_are_not_tools(self):
        class Env(IncrementEnv):
            def _helper(self):
                pass

        assert names_of(Environments(Env).tools_for(None)) == ["increment"]

    def test_factory_error_names_the_factory(self):
        def broken():
            raise RuntimeError("no GPU")

        with pytest.raises(RuntimeError, match="no GPU") as raised:
            Environments({"gpu": broken})
        assert "environment_factory['gpu']" in "".join(raised.value.__notes__)

    def test_reset_must_return_an_observation_or_none(self):
        class Env:
            def reset(self, **kwargs) -> int:
                return 3

        environments = Environments(Env)
        with pytest.raises(TypeError, match="Env.reset returned int"):
            environments.reset(environments.acquire([None]), [{}])


def test_pool_grows_and_is_reused():
    built = []

    def factory():
        built.append(GameEnv())
        return built[-1]

    environments = Environments({"game": factory, "coding": CodingEnv})
    assert len(built) == 1  # the probe
    first = environments.acquire(["game", "coding", "game"])
    assert len(built) == 2 and first[0] is built[0] and first[2] is built[1]
    second = environments.acquire(["game", "game", "game"])
    assert len(built) == 3 and second[:2] == [built[0], built[1]] and second[2] is built[2]
    third = environments.acquire(["coding", "game"])
    assert len(built) == 3 and third[0] is first[1] and third[1] is built[0]


class TestRewardFunctions:
    def test_one_per_class_with_none_for_others(self):
        class Quiz(GameEnv):
            def get_reward(self) -> float:
                return 0.5

        environments = Environments({"inc": IncrementEnv, "inc2": IncrementEnv, "quiz": Quiz, "coding": CodingEnv})
        functions = environments.reward_functions()
        assert [fn.__name__ for fn in functions] == ["IncrementEnv", "Quiz"]  # deduplicated, CodingEnv has none
        envs = environments.acquire(["inc", "quiz", "coding", "inc2"])
        environments.reset(envs, [{}] * 4)
        envs[0].increment(envs[0].target)
        increment_reward, quiz_reward = functions
        kwargs = {"prompts": ["p"] * 4, "completions": ["c"] * 4, "environments": envs}
        assert increment_reward(**kwargs) == [1.0, None, None, 0.0]
        assert quiz_reward(**kwargs) == [None, 0.5, None, None]

    def test_exact_class_match(self):
        class Sub(IncrementEnv):
            pass

        (reward,) = Environments(IncrementEnv).reward_functions()
        env = Sub()
        env.reset()
        assert reward(prompts=["p"], completions=["c"], environments=[env]) == [None]

    def test_async_get_reward(self):
        class Judge(GameEnv):
            async def get_reward(self) -> float:
                await asyncio.sleep(0.01)
                return float(getattr(self, "moves", 0))

        environments = Environments(Judge)
        envs = environments.acquire([None, None])
        environments.reset(envs, [{}, {}])
        envs[1].move("up")
        (reward,) = environments.reward_functions()
        assert reward.__name__ == "Judge"
        assert reward(prompts=["p", "q"], completions=["a", "b"], environments=envs) == [0.0, 1.0]

    def test_through_compute_rewards(self):
        environments = Environments(IncrementEnv)
        envs = environments.acquire([None, None])
        environments.reset(envs, [{}, {}])
        envs[1].increment(envs[1].target)
        result = compute_rewards(
            environments.reward_functions(),
            [1.0],
            prompts=["p", "p"],
            completions=["a", "b"],
            completion_ids=[[1], [2]],
            columns={"environments": envs},
        )
        assert result.total.tolist() == [0.0, 1.0] and list(result.values) == ["IncrementEnv"]


class TestAppendObservation:
    def test_strings_concatenate(self):
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Task: "}]
        before = copy.deepcopy(prompt)
        new = append_observation(prompt, "reach 3")
        assert new == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Task: reach 3"}]
        assert prompt == before and new[-1] is not prompt[-1]

    def test_list_observation(self):
        prompt = [{"role": "user", "content": "Look:"}]
        before = copy.deepcopy(prompt)
        image = {"type": "image", "image": "pixels"}
        assert append_observation(prompt, [image]) == [
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, image]}
        ]
        assert prompt == before

    def test_str_onto_list_content(self):
        prompt = [{"role": "user", "content": [{"type": "text", "text": "A"}]}]
        before = copy.deepcopy(prompt)
        assert append_observation(prompt, "B")[-1]["content"] == [
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B"},
        ]
        assert prompt == before

    def test_none_and_empty(self):
        prompt = [{"role": "user", "content": "x"}]
        assert append_observation(prompt, None) == prompt
        assert append_observation([], "Reach the goal tile.") == [{"role": "user", "content": "Reach the goal tile."}]

    def test_string_prompt(self):
        with pytest.raises(TypeError, match="list of chat messages"):
            append_observation("plain prompt", "obs")
