# A CUDA PyTorch image with this project installed. The image brings its own torch/torchvision, so the
# torch pins of requirements.txt are left out; everything else is installed from requirements.txt.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# A C++ compiler for the fused CPU attention kernel, which torch compiles on first use (backend fused_cpu).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/vil
COPY . .
RUN grep -v -E '^(torch|torchvision)==' requirements.txt > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt

CMD ["python", "tools/train.py", "--help"]
