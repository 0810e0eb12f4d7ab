/* SPDX-License-Identifier: MIT */
/* kvstaged. */
#include <stddef.h>

#include "daemon/daemon.h"

int main(int argc, char **argv)
{
	return kvsp_daemon_main(argc, argv, NULL);
}
