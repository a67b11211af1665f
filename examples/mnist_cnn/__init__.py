"""A small convolutional network on MNIST, where GradiVeQ, QSGD and PowerSGD
compress the conv kernels."""
