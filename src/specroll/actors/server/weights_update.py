"""``POST /update_weights``: a folder of safetensors (Hugging Face names, as prime-rl's trainer writes
them) published to every generator as the next policy version, so a trainer that speaks only HTTP
moves the policy and sees the new version in ``token_versions``.

The folder must lie inside ``server.weights_dir`` (links resolved: a client can make the server read
nothing else), hold at most :data:`MAX_FILES` ``*.safetensors`` files of at most twice the model's
float32 size in all (checked before one is read), and match the model's tensor names and shapes.
"""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specroll.actors.rollout.client import RolloutClient
from specroll.actors.server.errors import ApiError, bad_request
from specroll.engine.loaders.checkpoint import CheckpointError, check_weights
from specroll.engine.model_config import ModelConfig, expected_weight_shapes

MAX_FILES = 256


class FolderWeights:
    """Publishes weights folders as policy versions, one update at a time.

    Args:
        client: the hub.
        model: the policy's config (names and shapes the tensors must have).
        root: the folder updates may come from.
        timeout_s: seconds to wait for every generator to serve a new version.
    """

    def __init__(self, client: RolloutClient, model: ModelConfig, root: Path, timeout_s: float) -> None:
        self.client, self.model, self.root, self.timeout_s = client, model, root, timeout_s
        self.version = 0
        """The policy version published last (0: the generators' own weights)."""
        self._busy = False
        shapes = expected_weight_shapes(model).values()
        self.max_bytes = 2 * 4 * sum(math.prod(s) for s in shapes) + (1 << 20)

    def folder(self, path: str) -> Path:
        """``path`` (absolute, or relative to the root) resolved, if it is a folder inside the root.

        Raises:
            ApiError: 400 outside the root, missing, or not a folder.
        """
        root = self.root.resolve()
        folder = (root / path).resolve() if path else root
        if not folder.is_relative_to(root):
            raise bad_request(f"path {path[:200]!r} is outside the weights folder (server.weights_dir); expected a "
                              "folder inside it", param="path")
        if not folder.is_dir():
            raise bad_request(f"path {path[:200]!r} is not a folder inside server.weights_dir", param="path")
        return folder

    def _read(self, folder: Path) -> dict[str, torch.Tensor]:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise bad_request(f"{folder.name}: no *.safetensors files", param="path")
        if len(files) > MAX_FILES:
            raise bad_request(f"{folder.name}: {len(files)} safetensors files; at most {MAX_FILES}", param="path")
        size = sum(f.stat().st_size for f in files)
        if size > self.max_bytes:
            raise bad_request(f"{folder.name}: {size} bytes of safetensors; this model's weights are at most "
                              f"{self.max_bytes} bytes", param="path")
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                weights.update(load_file(file))
            except (SafetensorError, OSError) as e:
                raise bad_request(f"{file.name}: not a readable safetensors file ({e})", param="path") from None
        try:
            return check_weights(self.model, weights, folder.name)
        except CheckpointError as e:
            raise bad_request(str(e), param="path") from None

    async def __call__(self, path: str, version: int | None) -> int:
        """Read, check and publish the folder at ``path`` as ``version`` (None: the next one); wait
        until every connected generator serves it. Returns the version.

        Raises:
            ApiError: 400 for a bad folder or a version not above the last; 409 while another update
                runs; 504 when the generators did not all serve it within the timeout (it stays published).
        """
        if self._busy:
            raise ApiError(409, "another weight update is running; retry when it is done", code="update_running")
        target = self.version + 1 if version is None else version
        if target <= self.version:
            raise bad_request(f"version = {target}; expected one above the current policy version {self.version}",
                              param="version")
        folder = self.folder(path)
        self._busy = True
        try:
            weights = await anyio.to_thread.run_sync(self._read, folder)
            await self.client.publish_weights(weights, target)
            self.version = target
            try:
                await self.client.wait_for_version(target, timeout=self.timeout_s)
            except TimeoutError:
                raise ApiError(504, f"version {target} is published, but not every generator served it within "
                               f"{self.timeout_s} s (server.weights_timeout_s)", code="timeout") from None
        finally:
            self._busy = False
        return target
