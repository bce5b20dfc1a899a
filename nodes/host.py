"""What the nodes need to know about the ComfyUI they run in."""
from __future__ import annotations

from ..parallel_runtime.config import HostDevices, share_devices_requested


def host_devices() -> HostDevices:
    import torch
    import torch.distributed
    import comfy.model_management

    main = comfy.model_management.get_torch_device()
    main_str = str(main)
    if main_str == "cuda":
        main_str = f"cuda:{torch.cuda.current_device()}"
    cuda_count = torch.cuda.device_count() if main_str.startswith("cuda") else 0
    return HostDevices(main_device=main_str, cuda_count=cuda_count, nccl=torch.distributed.is_nccl_available(),
                       share_devices=share_devices_requested())
