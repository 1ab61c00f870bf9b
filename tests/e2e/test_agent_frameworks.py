"""Issue 17: agent frameworks against a real zserve on loopback (offline: nothing else is
reached), on the tiny random-weight llama. `tool_choice` "required" and named choices are
enforced by structured outputs, so the frameworks get valid calls whatever the weights."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import agents
import pydantic
import pytest
from e2e_http import EOS, MODEL
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

pytestmark = pytest.mark.timeout(240)


def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"]) -> str:
    """The weather in a city."""
    return f"18{unit} in {city}"


def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    return f"noon {zone}"


CITIES = {"Paris", "Rome", "Oslo"}


@pytest.fixture(scope="module")
def chat_model(tools_server):
    return ChatOpenAI(
        model=MODEL,
        base_url=tools_server.base_url + "/v1",
        api_key="none",
        # The tools' system prompt takes most of the tiny model's 1024-token context.
        max_tokens=85,
        max_retries=0,
        timeout=120,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_langchain_bind_tools_required_gets_valid_calls(chat_model, seed):
    model = chat_model.bind_tools(
        [get_weather, get_time], tool_choice="required", parallel_tool_calls=False, seed=seed
    )
    message = model.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1 and not message.invalid_tool_calls, message
    for call in message.tool_calls:
        assert call["name"] in ("get_weather", "get_time") and call["id"]
        if call["name"] == "get_weather":
            assert call["args"]["city"] in CITIES and call["args"]["unit"] in ("C", "F")
        else:
            assert call["args"] == {"zone": call["args"]["zone"]}
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_bind_tools_named_calls_that_tool(chat_model):
    model = chat_model.bind_tools([get_weather, get_time], tool_choice="get_time", seed=3)
    message = model.invoke("What time is it?")
    (call,) = message.tool_calls
    assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")
    # The call runs: its arguments fit the function.
    assert get_time(**call["args"]).startswith("noon")


def test_langchain_structured_output_returns_the_model(chat_model):
    class City(pydantic.BaseModel):
        name: Literal["Paris", "Rome"]
        population: int = pydantic.Field(ge=0, le=99)

    structured = chat_model.with_structured_output(City, method="json_schema")
    result = structured.invoke("Name a city.")
    assert isinstance(result, City)


def run_weather_agent(server, model_class, max_turns: int, **agent_kwargs) -> tuple:
    """The Agents SDK's forecaster on `server` through `model_class`, asked the weather
    in Oslo: (the run's result, the calls its weather tool got)."""
    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    calls: list[dict] = []

    @agents.function_tool
    def weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city."""
        calls.append({"city": city, "unit": unit})
        return get_weather(city, unit)

    async def run() -> object:
        client = AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather tool.",
            tools=[weather],
            model=model_class(model=MODEL, openai_client=client),
            **agent_kwargs,
        )
        try:
            return await agents.Runner.run(agent, "Weather in Oslo?", max_turns=max_turns)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and all(c["city"] in CITIES for c in calls), calls
    return result, calls


def test_openai_agents_chat_completions_model_runs_a_required_tool(tools_server):
    result, calls = run_weather_agent(
        tools_server,
        agents.OpenAIChatCompletionsModel,
        max_turns=2,
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=120,
            extra_body={"seed": 4, "logit_bias": {str(ord("]")): 3}},
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    assert result.final_output == get_weather(**calls[0])
    json.dumps(calls)  # plain JSON values reached the function


def test_openai_agents_responses_model_runs_a_tool_and_answers_with_its_output(tools_server):
    """The Agents SDK's default model class speaks /v1/responses. Turn one: a required
    tool call (a function_call item); turn two: the tool's output goes back as a
    function_call_output item and the model answers in text."""
    result, _ = run_weather_agent(
        tools_server,
        agents.OpenAIResponsesModel,
        max_turns=3,
        # EOS made likely: the call's grammar holds it back until the call is whole;
        # the answer (turn two) then ends at once, not at max_tokens.
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=150,
            extra_body={"seed": 4, "logit_bias": {str(EOS): 50, str(ord("]")): 3}},
        ),
        reset_tool_choice=True,  # after the tool ran, the model answers freely
    )
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
