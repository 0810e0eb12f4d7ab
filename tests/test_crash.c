#include <criterion/criterion.h>
Test(x, placeholder) {}
