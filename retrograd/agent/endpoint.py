"""A small client for OpenAI-compatible chat endpoints ([agent.judge], [agent.collect_api]): one
POST to BASE_URL/chat/completions with a time limit, retried on connection errors, timeouts, 429
and 5xx, the key read from the environment variable the configuration names. A `retrograd serve`
process is such an endpoint. Standard library only, so nothing here needs the openai package."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from retrograd.config import EndpointSection
from retrograd.errors import ConfigError, RetrogradError


class EndpointError(RetrogradError):
    """The endpoint could not be reached or kept failing."""


def check(ep: EndpointSection, where: str) -> None:
    if not ep.base_url:
        raise ConfigError(f"{where}.base_url is required")
    if not ep.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.base_url: expected an http:// or https:// URL, got {ep.base_url!r}")
    if ep.api_key_env and not os.environ.get(ep.api_key_env):
        raise ConfigError(f"{where}.api_key_env: the environment variable {ep.api_key_env} is not set")


def chat(ep: EndpointSection, messages: list[dict], *, tools: list[dict] | None = None, seed: int | None = None,
         temperature: float | None = None, where: str = "endpoint") -> dict:
    """The first choice's message of a chat completion; EndpointError after the retries."""
    body: dict = {"model": ep.model or "default", "messages": messages, "max_tokens": ep.max_tokens,
                  "temperature": ep.temperature if temperature is None else temperature}
    if tools:
        body["tools"] = tools
    if seed is not None:
        body["seed"] = seed
    headers = {"Content-Type": "application/json"}
    if ep.api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(ep.api_key_env, '')}"
    url = ep.base_url.rstrip("/") + "/chat/completions"
    last = ""
    for attempt in range(ep.retries + 1):
        if attempt:
            time.sleep(min(8.0, 0.5 * 2 ** attempt))
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=ep.timeout_seconds) as resp:
                data = json.loads(resp.read())
            return data["choices"][0]["message"]
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            last = f"HTTP {exc.code}: {detail}"
            if exc.code != 429 and exc.code < 500:
                break                   # our request is wrong: retrying will not help
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            last = f"{getattr(exc, 'reason', exc)}"
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            last = f"not a chat completion ({exc})"
    raise EndpointError(f"{where} {url} failed after {attempt + 1} attempt(s): {last}")
