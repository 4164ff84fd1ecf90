#!/usr/bin/env python3
"""Converts torchvision classifier weights into the safetensors file that shardtrain's image
models read with `shardtrain train --model NAME --init-from FILE.safetensors`.

The output holds the model's state dict under torchvision's names (parameters and batch norm's
running_mean / running_var), every tensor fp32; num_batches_tracked is dropped. Examples:

    python3 tools/convert_torchvision.py --pretrained mobilenet_v2 -o mobilenet_v2.safetensors
    python3 tools/convert_torchvision.py my_model.pth -o my_model.safetensors
    python3 tools/convert_torchvision.py --pretrained vgg11_bn --grayscale -o vgg11_bn_gray.safetensors

Then fine-tune on a data set with another class count (the classifier head is re-initialized):

    shardtrain train --model mobilenet_v2 --dataset fashion-mnist --image-size 64 \\
        --init-from mobilenet_v2_gray.safetensors --replace-head

Needs PyTorch (and torchvision for --pretrained, which downloads the weights); uses the
`safetensors` package when installed, else writes the format itself.
"""
import argparse
import json
import struct
import sys


def load_state_dict(args):
    """The state dict of --pretrained NAME or of the .pth file (a state dict, a checkpoint dict
    with "state_dict"/"model", or a pickled nn.Module); DataParallel's "module." is stripped."""
    import torch

    if args.pretrained:
        import torchvision

        return torchvision.models.get_model(args.pretrained, weights="DEFAULT").state_dict()
    try:
        obj = torch.load(args.pth, map_location="cpu", weights_only=True)
    except Exception:  # a pickled nn.Module needs the full unpickler: only for trusted files
        obj = torch.load(args.pth, map_location="cpu", weights_only=False)
    if hasattr(obj, "state_dict"):
        obj = obj.state_dict()
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        sys.exit(f"error: {args.pth} holds a {type(obj).__name__}, not a state dict")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in obj.items()}


def convert(state, grayscale):
    """fp32 contiguous tensors without num_batches_tracked; with `grayscale` the first
    convolution's 3 input channels are summed into 1 (for 1-channel images such as Fashion-MNIST)."""
    import torch

    out, first_conv = {}, True
    for name, t in state.items():
        if name.endswith("num_batches_tracked"):
            continue
        if not torch.is_tensor(t) or not torch.is_floating_point(t):
            sys.exit(f"error: '{name}' is not a floating-point tensor; is this a classifier state dict?")
        t = t.detach().cpu().to(torch.float32)
        if grayscale and first_conv and t.dim() == 4:
            if t.shape[1] != 3:
                sys.exit(f"error: --grayscale: the first convolution '{name}' has {t.shape[1]} input "
                         "channels, not 3")
            t = t.sum(dim=1, keepdim=True)
            first_conv = False
        out[name] = t.contiguous()
    if grayscale and first_conv:
        sys.exit("error: --grayscale: the state dict has no convolution weight")
    return out


def write_safetensors(path, tensors, metadata):
    """The safetensors format: u64 little-endian header size, JSON header, raw little-endian data."""
    try:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata=metadata)
        return
    except ImportError:
        pass
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        data = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    p = argparse.ArgumentParser(
        description="Convert torchvision classifier weights (.pth or --pretrained NAME) into "
        "fp32 safetensors with torchvision's state-dict names, for `shardtrain train --init-from`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: %(prog)s --pretrained mobilenet_v2 -o mobilenet_v2.safetensors")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("pth", nargs="?", help="a .pth/.pt file: state dict, checkpoint or nn.Module")
    src.add_argument("--pretrained", metavar="NAME",
                     help="torchvision.models.get_model(NAME, weights='DEFAULT'), e.g. mobilenet_v2, "
                     "efficientnet_b0, vgg11_bn, vgg16_bn")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    p.add_argument("--grayscale", action="store_true",
                   help="sum the first convolution's RGB input channels into one, for 1-channel "
                   "data sets such as Fashion-MNIST")
    args = p.parse_args()

    tensors = convert(load_state_dict(args), args.grayscale)
    source = args.pretrained or args.pth
    write_safetensors(args.output, tensors, {"format": "pt", "source": str(source)})
    heads = [(n, tuple(t.shape)) for n, t in tensors.items() if t.dim() == 2]
    head = f"; last linear layer {heads[-1][0]} {list(heads[-1][1])}" if heads else ""
    print(f"wrote {args.output}: {len(tensors)} fp32 tensors from {source}{head}")


if __name__ == "__main__":
    main()
