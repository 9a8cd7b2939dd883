"""A reward function that asks a remote segment reward model (``rlhf-ext serve rm``) for e_phi or for its segments::

    trainer = GRPOTrainer(model=policy, reward_funcs=[RemoteSegmentReward("http://127.0.0.1:5000")], ...)
    trainer = DensePPOTrainer(model=policy, reward_funcs=[RemoteSegmentReward(url, spans=True)], ...)  # dense

Per completion it returns ``e_phi`` (paper 003 Eq. 4), or with ``spans=True`` its segments as ``(char_start,
char_end, reward)`` spans (:mod:`rlhf_ext.runtime.spans`). Chat messages are sent as they are and rendered with the
reward model's own chat template on the server. OpenRLHF's launcher uses it for ``--reward.remote_url``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server refused a request (a 4xx answer: retrying would not help) or could not be reached."""


#: The environment variable holding the server's API key (as ``rlhf-ext serve rm`` reads it).
API_KEY_ENV = "RLHF_EXT_API_KEY"


def _post_json(url: str, payload: dict[str, Any], timeout: float, api_key: str | None) -> dict:
    """POST ``payload`` as JSON to ``url`` (directly: no proxy from the environment), with ``api_key`` as a bearer
    token when given, and parse the JSON answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read())


class RemoteSegmentReward:
    """A TRL reward function (``reward_funcs`` entry, picklable) scoring completions with the segment reward model
    served at ``url`` (``http://HOST:PORT``, or the full ``.../get_reward`` route).

    Args:
        batch_size: pairs per HTTP request (the server's ``--max-request-pairs`` must be at least this).
        timeout: seconds per request.
        retries, retry_wait_s: attempts per request on a connection error or a 5xx answer, and the pause between
            them (as OpenRLHF's client: 5 attempts, 1 s apart). A 4xx answer raises :class:`RemoteRewardError` at once.
        name: the function's ``__name__``, which TRL logs the reward under (``rewards/<name>/mean``).
        spans: return each completion's segment spans (a dense reward) instead of e_phi (a sequence reward).
        api_key: the server's API key, sent as a bearer token; default: ``$RLHF_EXT_API_KEY`` when set.

    The client connects directly, ignoring ``HTTP(S)_PROXY`` (as OpenRLHF's aiohttp client does).
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 64,
        timeout: float = 180.0,
        retries: int = 5,
        retry_wait_s: float = 1.0,
        name: str = "segment_rm",
        api_key: str | None = None,
        spans: bool = False,
    ):
        if retries < 1:
            raise ValueError(f"retries must be at least 1, got {retries}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        endpoint = url.rstrip("/")
        self.endpoint = endpoint if endpoint.endswith("/get_reward") else endpoint + "/get_reward"
        self.batch_size, self.timeout, self.retries, self.retry_wait_s = batch_size, timeout, retries, retry_wait_s
        self.__name__ = name  # TRL logs the reward as rewards/<__name__>/mean
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.spans = spans

    def _post(self, payload: dict[str, Any]) -> dict:
        for attempt in range(1, self.retries + 1):
            try:
                return _post_json(self.endpoint, payload, self.timeout, self.api_key)
            except urllib.error.HTTPError as e:
                message = e.read().decode(errors="replace")
                if e.code < 500:
                    raise RemoteRewardError(f"{self.endpoint} refused the request ({e.code}): {message}") from None
                problem = f"{e.code}: {message}"
            except OSError as e:  # URLError, refused connection, timeout
                problem = str(e)
            logger.warning("reward request %d/%d to %s failed: %s", attempt, self.retries, self.endpoint, problem)
            if attempt < self.retries:
                time.sleep(self.retry_wait_s)
        raise RemoteRewardError(f"{self.endpoint} did not answer after {self.retries} attempts: {problem}")

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list:
        """e_phi of each (prompt, completion), in order (with ``spans``: its segment spans); ``columns`` (TRL's other
        dataset columns, the trainer state, ...) are not used."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: one prompt per completion")
        out: list = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            answer = self._post({"prompts": list(prompts[chunk]), "responses": list(completions[chunk])})
            if not self.spans:
                out.extend(float(r) for r in answer["rewards"])
            elif "spans" not in answer:
                raise RemoteRewardError(f"{self.endpoint} answers without 'spans': serve the model with this "
                                        "rlhf-ext's `rlhf-ext serve rm`, or use spans=False for e_phi")  # fmt: skip
            else:
                out.extend([(int(a), int(b), float(r)) for a, b, r in row] for row in answer["spans"])
        return out
