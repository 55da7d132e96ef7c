"""The frameworks' own calls for tool calling and structured output against `fastdllm serve`
(slow; each skips when its framework is not installed). The embedded model was not trained to
call tools or write JSON, so these check what the server guarantees: well-formed calls and JSON
valid against the schema, parsed by the framework itself; not that the values are right."""

import pytest
from pydantic import BaseModel, ConfigDict, Field

import fastdllm

from .test_server import LiveServer

pytestmark = pytest.mark.slow
Q = "Tom has 5 apples. He buys 3 more apples. How many apples does Tom have now?"


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
    done = srv.client.chat.completions.parse(model="llada-arith", messages=[{"role": "user", "content": Q}],
                                             response_format=Answer, max_tokens=64)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.apples <= 1000


def test_langchain_structured_output_and_bound_tools(srv):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="llada-arith", base_url=srv.url + "/v1", api_key="unused", max_tokens=64,
                                      max_retries=0)
    result = llm.with_structured_output(Answer).invoke(Q)
    assert isinstance(result, Answer)
    message = llm.bind_tools([Add], tool_choice="Add").invoke(Q)
    assert message.tool_calls and message.tool_calls[0]["name"] == "Add"
    assert set(message.tool_calls[0]["args"]) <= {"a", "b"}


def test_instructor_tools_and_json_schema_modes(srv):
    instructor = pytest.importorskip("instructor")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(srv.client, mode=mode)
        result = client.chat.completions.create(model="llada-arith", response_model=Answer, max_tokens=64,
                                                max_retries=0, messages=[{"role": "user", "content": Q}])
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
