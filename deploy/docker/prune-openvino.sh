#!/bin/sh
# Deletes from an installed OpenVINO what its CPU plugin never loads: the Intel GPU and NPU plugins, the
# GPU kernel cache, the readers of other formats than ONNX (TensorFlow, TensorFlow Lite, PaddlePaddle,
# PyTorch, GGUF) and the C++ headers.
#
#   sh deploy/docker/prune-openvino.sh SITE_PACKAGES
#
# SITE_PACKAGES: the folder OpenVINO was installed into (a site-packages, or a `pip install --target`
# folder). cpu-onnx.Dockerfile runs it on the image's site-packages, and the imagesize bench section
# (loadtests/bench_image.py) on a --target folder, so the size that section reports is the image's.
set -eu
cd "$1/openvino"
rm -rf include libs/cache.json libs/libopenvino_intel_gpu_plugin.so libs/libopenvino_intel_npu_plugin.so \
    libs/libopenvino_tensorflow_frontend.so* libs/libopenvino_tensorflow_lite_frontend.so* \
    libs/libopenvino_paddle_frontend.so* libs/libopenvino_pytorch_frontend.so* \
    libs/libopenvino_gguf_frontend.so*
