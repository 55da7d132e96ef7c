"""The frameworks' own calls for tool calling and structured output against `fastdllm serve`
(slow; each skips when its framework is not installed). The embedded model was not trained to
call tools or write JSON, so these check what the server guarantees: well-formed calls and JSON
valid against the schema, parsed by the framework itself; not that the values are right."""

from typing import Annotated

import pytest
from pydantic import BaseModel, ConfigDict, Field

import fastdllm

from .test_server import LiveServer

pytestmark = pytest.mark.slow
Q = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"
# A tool's integer parameters, bounded as `Add`'s are: an unbounded integer lets a model that was
# never taught to call tools write digits until max_tokens runs out (the grammar cannot end it).
Small = Annotated[int, Field(ge=0, le=1000)]


class Answer(BaseModel):
    """The number of apples."""

    # No other keys, numbers bounded: an answer the grammar can close within max_tokens whatever
    # the model wants to write (a schema that allows extra keys lets a model go on adding them).
    model_config = ConfigDict(extra="forbid")
    apples: int = Field(ge=0, le=1000)


class Add(BaseModel):
    """Add two numbers."""

    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=0, le=1000)
    b: int = Field(ge=0, le=1000)


@pytest.fixture(scope="module")
def srv():
    server = LiveServer(*fastdllm.load(dtype="float32"))
    yield server
    server.stop()


def test_openai_parse_with_a_pydantic_model(srv):
    done = srv.client.chat.completions.parse(
        model="llada-arith", messages=[{"role": "user", "content": Q}], response_format=Answer, max_tokens=64
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.apples <= 1000


def test_langchain_structured_output_and_bound_tools(srv):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="llada-arith", base_url=srv.url + "/v1", api_key="unused", max_tokens=64, max_retries=0
    )
    result = llm.with_structured_output(Answer).invoke(Q)
    assert isinstance(result, Answer)
    message = llm.bind_tools([Add], tool_choice="Add").invoke(Q)
    assert message.tool_calls and message.tool_calls[0]["name"] == "Add"
    assert set(message.tool_calls[0]["args"]) <= {"a", "b"}


def test_instructor_tools_and_json_schema_modes(srv):
    instructor = pytest.importorskip("instructor")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(srv.client, mode=mode)
        result = client.chat.completions.create(
            model="llada-arith",
            response_model=Answer,
            max_tokens=64,
            max_retries=0,
            messages=[{"role": "user", "content": Q}],
        )
        assert isinstance(result, Answer), mode


def test_pydantic_ai_tool_output_and_native_output(srv):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("llada-arith", provider=OpenAIProvider(base_url=srv.url + "/v1", api_key="unused"))
    settings = {"max_tokens": 64}
    for output in (Answer, NativeOutput(Answer)):
        result = Agent(model, output_type=output, model_settings=settings, retries=0).run_sync(Q)
        assert isinstance(result.output, Answer)


def test_litellm_tool_call_and_json_schema(srv):
    litellm = pytest.importorskip("litellm")
    common = dict(
        model="openai/llada-arith",
        api_base=srv.url + "/v1",
        api_key="unused",
        max_tokens=64,
        messages=[{"role": "user", "content": Q}],
    )
    tool = {
        "type": "function",
        "function": {"name": "Add", "description": Add.__doc__, "parameters": Add.model_json_schema()},
    }
    done = litellm.completion(**common, tools=[tool], tool_choice={"type": "function", "function": {"name": "Add"}})
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "Add"
    Add.model_validate_json(call.function.arguments)
    done = litellm.completion(**common, response_format=Answer)
    Answer.model_validate_json(done.choices[0].message.content)


def test_llama_index_structured_predict_and_forced_tool(srv):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model="llada-arith",
        api_base=srv.url + "/v1",
        api_key="unused",
        max_tokens=64,
        is_chat_model=True,
        is_function_calling_model=True,
        max_retries=0,
    )
    result = llm.structured_predict(Answer, PromptTemplate("{question}"), question=Q)  # tool_choice "required"
    assert isinstance(result, Answer)
    calls = []

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    # llama-index drops Annotated bounds from a function's schema: `Add` states them
    tool = FunctionTool.from_defaults(fn=add, fn_schema=Add)
    response = llm.predict_and_call([tool], Q, tool_required=True)  # tool_choice "required"
    assert calls and all(isinstance(v, int) for v in calls[0]) and response.response == str(sum(calls[0]))


def test_openai_agents_function_tool_and_output_type(srv):
    pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing may leave the machine
    model = OpenAIChatCompletionsModel(
        model="llada-arith", openai_client=AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    )
    calls = []

    @function_tool
    def add(a: Small, b: Small) -> int:
        """Add two numbers."""
        calls.append((a, b))
        return a + b

    agent = Agent(
        name="calculator",
        instructions="Use the tool.",
        tools=[add],
        model=model,
        model_settings=ModelSettings(tool_choice="add", max_tokens=64),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, Q, max_turns=2)
    assert calls and str(result.final_output) == str(sum(calls[0]))
    typed = Agent(
        name="counter",
        instructions="Answer.",
        model=model,
        output_type=Answer,
        model_settings=ModelSettings(max_tokens=64),
    )
    assert isinstance(Runner.run_sync(typed, Q, max_turns=1).final_output, Answer)
